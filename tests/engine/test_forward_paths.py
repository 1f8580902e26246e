"""The runner's forward paths (engine/runner/forward_paths.py): the first that can run a batch
runs it, the faster paths take only decode steps that score no prompt, and the model's forward
takes whatever is left."""

from __future__ import annotations

import torch

from pdserve.engine.batch import build_flat_batch
from pdserve.engine.runner.forward_paths import (
    DecodeBatch,
    ForwardBatch,
    ModelForward,
    OneTokenDecode,
    choose,
)

CPU = torch.device("cpu")


def forward_batch(chunks: list[list[int]], context_lens: list[int], scores_prompts=False):
    flat = build_flat_batch(
        chunks, context_lens, [[0, 1, 2]] * len(chunks), [True] * len(chunks), 16, CPU
    )
    return ForwardBatch(flat, flat.logits_indices, scores_prompts)


def paths():
    return [OneTokenDecode(step=None), DecodeBatch(step=None), ModelForward(None, None)]


def test_one_sequence_decoding_takes_the_one_token_step():
    assert choose(paths(), forward_batch([[7]], [12])).name == "one_token_step"


def test_a_batch_of_decodes_takes_the_decode_batch_step():
    assert choose(paths(), forward_batch([[7], [8]], [12, 30])).name == "decode_batch_step"


def test_prefills_mixed_steps_and_prompt_scoring_take_the_models_forward():
    assert choose(paths(), forward_batch([[7, 8, 9]], [0])).name == "model"
    assert choose(paths(), forward_batch([[7], [8, 9]], [12, 0])).name == "model"
    assert choose(paths(), forward_batch([[7]], [0])).name == "model"  # a one-token prompt
    assert choose(paths(), forward_batch([[7]], [12], scores_prompts=True)).name == "model"


def test_without_the_faster_paths_every_batch_takes_the_models_forward():
    assert choose([ModelForward(None, None)], forward_batch([[7]], [12])).name == "model"
