"""Step costs with known coefficients, and the profile they would have been measured as: the
planner's tests know every answer in advance."""

from __future__ import annotations

from pdserve.planner.profile_file import Profile, StepSample, ThreadTable
from pdserve.planner.profile_model import StepCost

# overhead 10 ms, 1 ms per prompt token, 1e-7 s per attention pair, 2 ms per decoded sequence,
# 1 us per context token it reads
COST = StepCost((0.010, 0.001, 1e-7, 0.002, 1e-6))
KV_BYTES_PER_TOKEN = 1000
TRANSFER_BYTES_PER_S = 1e6  # 1 ms per token: slow enough to see


def samples(cost: StepCost = COST) -> list[StepSample]:
    """The steps `pdserve profile` measures, timed by `cost` exactly."""
    out = []
    for tokens in (32, 128, 512, 2048):
        sample = StepSample.prefill(tokens, 0, 0.0)
        out.append(StepSample(tokens, sample.prefill_pairs, 0, 0,
                              cost.seconds(tokens, sample.prefill_pairs, 0, 0)))
    for batch in (1, 4, 8):
        for context in (128, 1024):
            seconds = cost.seconds(0, 0, batch, batch * context)
            out.append(StepSample(0, 0, batch, batch * context, seconds))
    return out


def known_profile(threads: tuple[int, ...] = (1, 2)) -> Profile:
    return Profile(
        model="known", dtype="float32", device="cpu", block_size=16,
        max_num_batched_tokens=2048, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        kv_capacity_tokens=1 << 20, transfer_bytes_per_s=TRANSFER_BYTES_PER_S,
        tables=[ThreadTable(n, samples()) for n in threads],
        machine={"date": "2026-12-04", "cpu": "test"}, seconds=1.0,
    )
