"""How a generation's choices travel to the nodes: ONE Generate per prompt carrying its n
choices, so the prompt is computed (and, disaggregated, transferred) once and forked into them
on the node (engine/forks.py); each choice keeps its own sub-request id (`<request id>-<choice
index>`, the index being prompt x n + i) and its own sampling settings (seed + i), under which
its tokens, failures and aborts travel.

A prompt's choices go one message each instead when they cannot be forked from one prompt:
structured output (the engine gives each sequence its own grammar matcher, not its children).
A retried choice (router/cluster/node_client.py) is always sent again alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.api.validation import Plan
from pdserve.wire.sampling_params import SamplingParams


@dataclass
class ChoiceGroup:
    """Choices of one prompt sent in one message under `prompt_id` (or, with one choice,
    under that choice's own id)."""

    prompt_id: str
    prompt: list[int]
    indices: list[int]
    choices: list[tuple[str, SamplingParams]]  # (sub-request id, its sampling settings)


def choice_groups(request_id: str, plan: Plan) -> list[ChoiceGroup]:
    """The messages a plan's choices travel in, in choice order."""
    groups = []
    per_prompt = plan.choices_per_prompt
    for prompt_index, prompt in enumerate(plan.prompts):
        indices = list(range(prompt_index * per_prompt, (prompt_index + 1) * per_prompt))
        choices = [(f"{request_id}-{i}", plan.samplings[i]) for i in indices]
        if any(sampling.structured_output is not None for _, sampling in choices):
            groups += [
                ChoiceGroup(sub_id, prompt, [i], [(sub_id, sampling)])
                for i, (sub_id, sampling) in zip(indices, choices)
            ]
        else:
            groups.append(ChoiceGroup(f"{request_id}-p{prompt_index}", prompt, indices, choices))
    return groups
