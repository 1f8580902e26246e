"""Penalties and logit biases: the edits to a batch's logits, before any row picks its token,
that can change the argmax, so they apply to greedy rows too. vLLM's semantics and order:

  1. logit_bias:   logits[t] += bias[t] for the ids a row's `logit_bias` names;
  2. repetition:   for every id in the row's prompt or output so far, a logit > 0 is divided
                   by `repetition_penalty` and a logit <= 0 multiplied by it (transformers'
                   RepetitionPenaltyLogitsProcessor);
  3. frequency and presence: logits[t] -= frequency * count[t] + presence * (count[t] > 0),
                   count[t] being how often t is in the row's OUTPUT so far (OpenAI's).

Each is one batched tensor operation over the rows that use it; a batch where no row uses one
skips it entirely, and rows that don't use it are left bit-for-bit as they were. A row's result
depends on its own logits and history only, so seeded rows are reproducible in any batch.

The penalties touch only the ids in each row's history, never a [rows, vocab] count tensor,
so their cost grows with the histories, not with the vocabulary: every step, the penalized rows'
`token_id_array()`s (kept incrementally by each sequence) become one flat index into the
logits (one concatenation, one copy to the device). Repetition gathers the logits there, scales
them and scatters them back (as transformers does; an id seen twice writes the same value
twice). Frequency adds -frequency once per occurrence (index_add_), presence -presence once per
distinct id (gather, add, scatter): equal addends, so the result does not depend on their order
(deterministic on CUDA too) and is within a few ulps of logit - frequency * count. Nothing is
kept between steps, so nothing goes stale when a step is retried, a sequence is preempted or
its first token was sampled on another node. Ids outside the logits' vocabulary are left out
(the engine refuses them at admission; this keeps any row from failing the rows batched with it).
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.sequence import Sequence

# A repetition penalty below this acts as this: it already lifts every seen token with a
# positive logit above all others, and dividing by less could overflow fp32 logits to inf.
REPETITION_PENALTY_FLOOR = 1e-5


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Adds each row's `logit_bias` to `logits` ([len(seqs), vocab], fp32), in place."""
    biased = [(row, seq.params.logit_bias) for row, seq in enumerate(seqs) if seq.params.logit_bias]
    if not biased:
        return
    vocab = logits.shape[-1]
    token_ids = np.concatenate([np.fromiter(b, np.int64, len(b)) for _, b in biased])
    biases = np.concatenate([np.fromiter(b.values(), np.float32, len(b)) for _, b in biased])
    rows = np.repeat([row for row, _ in biased], [len(b) for _, b in biased])
    in_vocab = token_ids < vocab
    index = torch.from_numpy(np.stack([rows[in_vocab], token_ids[in_vocab]]))
    index = index.to(logits.device)
    values = torch.from_numpy(biases[in_vocab]).to(logits.device)
    logits.index_put_((index[0], index[1]), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Applies each row's repetition, frequency and presence penalties to `logits`
    ([len(seqs), vocab], fp32), in place, in that order (vLLM's)."""
    rows = [row for row, seq in enumerate(seqs) if seq.params.penalized]
    if not rows:
        return
    device = logits.device
    vocab = logits.shape[-1]
    penalized = [seqs[row] for row in rows]
    factors = torch.tensor(
        [
            (
                max(seq.params.repetition_penalty, REPETITION_PENALTY_FLOOR),
                -seq.params.frequency_penalty,
                -seq.params.presence_penalty,
            )
            for seq in penalized
        ],
        dtype=logits.dtype,
    ).to(device)
    repetition, minus_frequency, minus_presence = factors.T
    histories = [seq.token_id_array() for seq in penalized]
    row_index = None
    if len(rows) == len(seqs) and logits.is_contiguous():
        penalized_logits = logits
    else:
        row_index = torch.tensor(rows, device=device)
        penalized_logits = logits.index_select(0, row_index)
    flat_logits = penalized_logits.view(-1)
    if any(seq.params.repetition_penalty != 1.0 for seq in penalized):
        seen = _flat_index(
            [
                h if s.params.repetition_penalty != 1.0 else h[:0]
                for h, s in zip(histories, penalized)
            ],
            vocab,
            device,
        )
        seen_logits = flat_logits[seen]
        scales = repetition[seen // vocab]
        flat_logits[seen] = torch.where(seen_logits > 0, seen_logits / scales, seen_logits * scales)
    if any(seq.params.frequency_penalty or seq.params.presence_penalty for seq in penalized):
        outputs = _flat_index(
            [h[seq.num_prompt_tokens :] for h, seq in zip(histories, penalized)], vocab, device
        )
        output_rows = outputs // vocab
        flat_logits.index_add_(0, outputs, minus_frequency[output_rows])
        flat_logits[outputs] = flat_logits[outputs] + minus_presence[output_rows]
    if row_index is not None:
        logits.index_copy_(0, row_index, penalized_logits)


def _flat_index(token_ids: list[np.ndarray], vocab: int, device: torch.device) -> torch.Tensor:
    """Where each row's ids fall in its flattened [len(token_ids), vocab] logits, ids outside
    the vocabulary left out: one concatenation and one copy to the device."""
    lengths = [len(ids) for ids in token_ids]
    flat_ids = np.concatenate(token_ids)
    flat_index = np.repeat(np.arange(len(token_ids), dtype=np.int64) * vocab, lengths) + flat_ids
    return torch.from_numpy(flat_index[(flat_ids >= 0) & (flat_ids < vocab)]).to(device)
