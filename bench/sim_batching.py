"""Batching policies and KV layouts compared by simulation, with a stand-in for the model.

    python -m pdserve.bench.sim_batching [--requests 512 --rate 0.5 --batch 32]

No model runs: a step "computes" whatever is scheduled in it. Requests arrive as a Poisson
process (per step) with prompt and output lengths from a chat-like distribution, and run under
  static      batches of exactly `--batch` requests (waits to fill), each until its longest member ends;
  dynamic     a batch of whatever waits (up to `--batch`) whenever the engine is idle, run to its end;
  continuous  pdserve's real Scheduler and BlockManager: admission and retirement every step.
Reported: steps to finish everything, mean latency in steps, slot utilisation (running
sequences / batch size, per step), and for continuous batching the KV waste of paged blocks
against contiguous per-request reservations of prompt + max_tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.bench.machine import command_line, machine_info
from pdserve.bench.report import md_table
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sched.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.wire.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "sim_batching.md"


@dataclass(frozen=True)
class SimRequest:
    arrival: int
    prompt: int
    output: int


@dataclass
class Outcome:
    steps: int
    latencies: list[int]
    utilisation: list[float]


def make_requests(count: int, rate: float, max_output: int, seed: int) -> list[SimRequest]:
    """Chat-like lengths: log-normal prompts (median ~180 tokens) and outputs (median ~120)."""
    rng = random.Random(seed)
    requests, step = [], 0.0
    for _ in range(count):
        step += rng.expovariate(rate)
        prompt = min(2048, max(4, int(rng.lognormvariate(5.2, 0.8))))
        output = min(max_output, max(1, int(rng.lognormvariate(4.8, 0.9))))
        requests.append(SimRequest(int(step), prompt, output))
    return requests


def run_request_level(requests: list[SimRequest], batch: int, wait_for_full: bool) -> Outcome:
    """Static (wait_for_full) or dynamic batching: a batch runs prefill then decodes until its
    longest member ends; nothing joins a running batch."""
    queue, pending = [], list(requests)
    step, latencies, utilisation = 0, [], []
    while pending or queue:
        while pending and pending[0].arrival <= step:
            queue.append(pending.pop(0))
        ready = len(queue) >= batch or (queue and (not wait_for_full or not pending))
        if not ready:
            step = pending[0].arrival
            continue
        members, queue = queue[:batch], queue[batch:]
        length = 1 + max(r.output for r in members)  # one prefill step, then decodes
        for offset in range(length):
            active = sum(1 for r in members if offset <= r.output)
            utilisation.append(active / batch)
        step += length
        latencies.extend(step - r.arrival for r in members)
    return Outcome(step, latencies, utilisation)


def run_continuous(
    requests: list[SimRequest], batch: int, num_blocks: int, block_size: int, max_tokens: int
):
    """pdserve's scheduler and block manager, a stand-in forward; also the KV waste per step,
    paged against a contiguous reservation of prompt + max_tokens per request."""
    manager = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(manager, max_num_batched_tokens=2048, max_num_seqs=batch)
    pending, latencies, utilisation = list(requests), [], []
    paged_waste, contiguous_waste = [], []
    arrivals: dict[str, SimRequest] = {}
    step = 0
    while pending or scheduler.num_unfinished:
        while pending and pending[0].arrival <= step:
            request = pending.pop(0)
            name = f"r{len(arrivals)}"
            arrivals[name] = request
            params = SamplingParams(max_tokens=request.output, ignore_eos=True)
            scheduler.add(
                Sequence(name, [1] * request.prompt, params, frozenset(), torch.device("cpu"))
            )
        out = scheduler.schedule()
        step += 1
        if out.is_empty:
            continue
        for scheduled in out.scheduled:
            seq = scheduled.seq
            samples = scheduled.completes_prompt
            seq.num_computed_tokens += scheduled.num_new_tokens
            if samples and seq.append_token(1) is not None:
                scheduler.finish(seq, "length")
                latencies.append(step - arrivals[seq.request_id].arrival)
        running = scheduler.running
        utilisation.append(len(running) / batch)
        used = sum(s.num_tokens for s in running)
        if used:
            paged_waste.append(
                1 - used / (manager.num_blocks - manager.num_free_blocks) / block_size
            )
            reserved = sum(arrivals[s.request_id].prompt + max_tokens for s in running)
            contiguous_waste.append(1 - used / reserved)
    manager.check_integrity([])
    return Outcome(step, latencies, utilisation), paged_waste, contiguous_waste


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.sim_batching")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--rate", type=float, default=0.5, help="arrivals per step")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    requests = make_requests(args.requests, args.rate, args.max_output, args.seed)
    outcomes = {
        "static": run_request_level(requests, args.batch, wait_for_full=True),
        "dynamic": run_request_level(requests, args.batch, wait_for_full=False),
    }
    outcomes["continuous"], paged, contiguous = run_continuous(
        requests, args.batch, args.num_blocks, 16, args.max_output
    )
    rows = [
        [
            name,
            f"{o.steps:,}",
            f"{statistics.fmean(o.latencies):,.0f}",
            f"{statistics.fmean(o.utilisation):.1%}",
            f"{outcomes['static'].steps / o.steps:.2f}x",
        ]
        for name, o in outcomes.items()
    ]
    machine = machine_info()
    text = (
        "\n\n".join(
            [
                "# Batching and KV layout, simulated",
                (
                    f"Command: `{command_line()}`  \nMachine: {machine['cpu']}, "
                    f"{machine['cores']}; date: {machine['date']} (step counts do not depend on "
                    "the machine)"
                ),
                (
                    f"{args.requests} requests, Poisson arrivals at {args.rate} per step, prompts "
                    "log-normal (median ~180 tokens, at most 2,048), outputs log-normal (median ~120, "
                    f"at most {args.max_output}); batch size {args.batch}. Continuous batching is "
                    "pdserve's own Scheduler and BlockManager with a stand-in forward (every scheduled "
                    "token computed in its step)."
                ),
                md_table(
                    [
                        "policy",
                        "steps to finish",
                        "mean latency (steps)",
                        "slot utilisation",
                        "speed-up vs static",
                    ],
                    rows,
                ),
                md_table(
                    [
                        "KV layout (continuous batching)",
                        "mean share of reserved KV holding no token",
                    ],
                    [
                        ["paged, 16-token blocks", f"{statistics.fmean(paged):.1%}"],
                        [
                            f"contiguous, prompt + max_tokens ({args.max_output:,}) per request",
                            f"{statistics.fmean(contiguous):.1%}",
                        ],
                    ],
                ),
            ]
        )
        + "\n"
    )
    print(text)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
