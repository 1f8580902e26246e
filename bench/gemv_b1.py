"""Batch-1 matrix-vector products over a model's weight shapes: how fast each of torch's CPU
kernels reads the weights of a decode step, against the machine's read bandwidth.

A round multiplies a [1, in] vector by every linear weight of the model once, layer after
layer, then the LM head: the bytes a batch-1 decode step streams, far more than any cache
holds, so each weight comes from memory as in a real step. Every kernel runs one round in turn
(fp32 F.linear, fp32 prepacked, bf16 F.linear, bf16 prepacked, bf16 torch.mv, ...), and each
number is the best of `--rounds` interleaved rounds: on a shared small machine another process's
burst stalls whichever kernel it overlaps, and interleaving spreads that over all of them.

GB/s is weight bytes / round time; "of read" divides it by bench/bandwidth.py's read bandwidth,
measured in the same run (the roofline of bench/offline.py). A kernel at 100% would make the
batch-1 step's linears as fast as this machine allows.

    python -m pdserve.bench.gemv_b1            # writes bench/results/gemv_b1.md
    python -m pdserve.bench.gemv_b1 --quick    # a smoke run; writes nothing
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.bench.bandwidth import measure_bandwidth
from pdserve.bench.machine import command_line, load_average, machine_info

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Kernel:
    name: str
    dtype: torch.dtype
    prepare: Callable[[torch.Tensor], torch.Tensor]  # the weight [out, in] -> its operand
    call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [1, in], operand)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _packed_call(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def kernels() -> list[Kernel]:
    found = [
        Kernel("F.linear", torch.float32, lambda w: w, lambda x, w: F.linear(x, w)),
        Kernel("torch.mv", torch.float32, lambda w: w, lambda x, w: torch.mv(w, x[0])),
        Kernel("F.linear", torch.bfloat16, lambda w: w, lambda x, w: F.linear(x, w)),
        Kernel("torch.mv", torch.bfloat16, lambda w: w, lambda x, w: torch.mv(w, x[0])),
    ]
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        found.insert(1, Kernel("oneDNN prepacked", torch.float32, _packed, _packed_call))
        found.insert(4, Kernel("oneDNN prepacked", torch.bfloat16, _packed, _packed_call))
    return found


def model_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of every linear weight of a decode step, in order: per layer q|k|v, o,
    gate|up, down; then the LM head."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads", heads)
    intermediate = config["intermediate_size"]
    layer = [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * intermediate, hidden),
        (hidden, intermediate),
    ]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], hidden)]


@torch.inference_mode()
def measure(shapes: list[tuple[int, int]], rounds: int, seed: int) -> list[tuple[Kernel, float]]:
    """Best round time of each kernel, rounds interleaved across kernels."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(out, inp, generator=generator) * 0.02 for out, inp in shapes]
    prepared = []
    for kernel in kernels():
        operands = [kernel.prepare(w.to(kernel.dtype)) for w in weights]
        inputs = [torch.randn(1, inp, generator=generator).to(kernel.dtype) for _, inp in shapes]
        prepared.append((kernel, operands, inputs))
    best = [float("inf")] * len(prepared)
    for round_index in range(rounds + 1):  # round 0 warms up (page faults, thread pools)
        for i, (kernel, operands, inputs) in enumerate(prepared):
            start = time.perf_counter()
            for x, operand in zip(inputs, operands):
                kernel.call(x, operand)
            if round_index:
                best[i] = min(best[i], time.perf_counter() - start)
    return [(kernel, seconds) for (kernel, _, _), seconds in zip(prepared, best)]


def build_report(args, machine, model_name, shapes, bandwidth, timings) -> str:
    params = sum(out * inp for out, inp in shapes)
    lines = [
        "# Batch-1 matrix-vector products: torch's CPU kernels vs the read bandwidth",
        "",
        f"Command: `{command_line()}`",
        "",
        "| machine |  |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in machine.items()),
        "",
        (f"Weights: the linear layers and LM head of `{model_name}` ({len(shapes)} matrices, "
        f"{params / 1e6:.1f} M parameters), one round = each multiplied once by a [1, in] vector"
        f"; best of {args.rounds} interleaved rounds. Read bandwidth in the same run: sum "
        f"{bandwidth.sum_read / 1e9:.1f} GB/s, GEMV (fp32) {bandwidth.gemv_read / 1e9:.1f} GB/s;"
        f" the better, {bandwidth.read / 1e9:.1f} GB/s, is 100%."),
        "",
        "| dtype | kernel | round (ms) | weight bytes (MB) | GB/s | of read | floor (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kernel, seconds in timings:
        nbytes = params * torch.finfo(kernel.dtype).bits // 8
        rate = nbytes / seconds
        lines.append(
            f"| {str(kernel.dtype).removeprefix('torch.')} | {kernel.name} | "
            f"{seconds * 1e3:.2f} | {nbytes / 1e6:.0f} | {rate / 1e9:.1f} | "
            f"{rate / bandwidth.read:.0%} | {nbytes / bandwidth.read * 1e3:.2f} |"
        )
    lines += ["", f"Load average at end: {load_average()}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.gemv_b1")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run; writes nothing")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from pdserve.model_store.default_model import ensure_default_model

        model_path = ensure_default_model()
    else:
        model_path = Path(args.model)
    config = json.loads((model_path / "config.json").read_text())
    shapes = model_shapes(config)
    if args.quick:
        shapes, args.rounds = shapes[:4] + shapes[-1:], 1
    machine = machine_info()
    bandwidth = measure_bandwidth()
    timings = measure(shapes, args.rounds, args.seed)
    bandwidth = bandwidth.best_of(measure_bandwidth())
    text = build_report(args, machine, model_path.name, shapes, bandwidth, timings)
    print(text)
    if not args.quick:
        (RESULTS / "gemv_b1.md").write_text(text)


if __name__ == "__main__":
    main()
