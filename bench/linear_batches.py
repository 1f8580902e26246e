"""The linears of a decode batch and of a prefill chunk, by tokens: pdserve's panels
(kernels/cpu_panel_linear.py, the engine's fp32 and int8 path for two tokens and more; and
kernels/cpu_int4_linear.py's 4-bit ones, its path for any count) against oneDNN's prepacked fp32
matmul for the same weights, side by side in one run.

A round multiplies a [tokens, in] input by every decoder weight of the model once (per layer
q|k|v, o, gate|up, down; the LM head left out, as a step multiplies only the last token of each
sequence by it), weights from memory as in a real step. Kernels:
  - oneDNN's prepacked fp32 matmul (`torch.ops.mkldnn._linear_pointwise`: the engine's fp32
    path before panels, and still where numba is missing),
  - pdserve's panels of the fp32 weights, every scale 1,
  - pdserve's panels of the weights quantized to int8 (one scale per output row),
  - pdserve's 4-bit panels (a scale and minimum per row and 32 inputs, inputs rounded to int8).
torch's own int8 weight-only kernel (`_weight_int8pack_mm`) is no peer here: it took 1.5 s a
round at 16 tokens, 30x the panels' time. Each number is the best of `--rounds` rounds, the
kernels interleaved in every round (on a shared machine a burst of another process then stalls
all of them, not one). GF/s counts two operations per weight and token.

    python -m pdserve.bench.linear_batches    # writes bench/results/linear_batches.md
    python -m pdserve.bench.linear_batches --quick    # a smoke run; writes nothing
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.bench.gemv_b1 import model_weight_shapes
from pdserve.bench.machine import load_average, machine_info, report_head
from pdserve.engine.layers.int8_weight import Int8Weight
from pdserve.kernels import cpu_int4_linear, cpu_panel_linear

RESULTS = Path(__file__).parent / "results"
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
NO_BIAS = np.zeros(0, np.float32)


@dataclass(frozen=True)
class Kernel:
    name: str
    prepare: Callable[[torch.Tensor], object]  # fp32 weight [out, in] -> the operand
    call: Callable[[torch.Tensor, object], torch.Tensor]  # (x [tokens, in] fp32, operand)


def _onednn(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _onednn_call(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _fp32_panels(weight: torch.Tensor) -> tuple:
    return cpu_panel_linear.pack_panels(weight).numpy(), np.ones(weight.shape[0], np.float32)


def _int8_panels(weight: torch.Tensor) -> tuple:
    int8 = Int8Weight.quantize(weight, None)
    return cpu_panel_linear.pack_panels(int8.quantized).numpy(), int8.scale.numpy()


def _panels_call(x: torch.Tensor, operand: tuple) -> torch.Tensor:
    return cpu_panel_linear.panel_linear(operand[0], operand[1], x, NO_BIAS)


def _int4_panels(weight: torch.Tensor) -> tuple:
    return cpu_int4_linear.pack(*cpu_int4_linear.quantize(weight)).numpy(), weight.shape[0]


def _int4_call(x: torch.Tensor, operand: tuple) -> torch.Tensor:
    return cpu_int4_linear.int4_linear(operand[0], x, NO_BIAS, operand[1])


KERNELS = (
    ("fp32", Kernel("oneDNN prepacked", _onednn, _onednn_call)),
    ("fp32", Kernel("pdserve panels", _fp32_panels, _panels_call)),
    ("int8", Kernel("pdserve panels", _int8_panels, _panels_call)),
    ("int4", Kernel("pdserve panels", _int4_panels, _int4_call)),
)


@torch.inference_mode()
def measure(
    shapes: list[tuple[int, int]], tokens: tuple[int, ...], rounds: int, seed: int
) -> dict[tuple[str, str, int], float]:
    """Best round time of each (dtype, kernel, tokens), the kernels interleaved per round."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(out, inp, generator=generator) * 0.02 for out, inp in shapes]
    operands = [[kernel.prepare(w) for w in weights] for _, kernel in KERNELS]
    best: dict[tuple[str, str, int], float] = {}
    for count in tokens:
        inputs = {inp: torch.randn(count, inp, generator=generator) for _, inp in shapes}
        for round_index in range(rounds + 1):  # round 0 warms up (compiles, page faults)
            for (dtype, kernel), kernel_operands in zip(KERNELS, operands):
                start = time.perf_counter()
                for (_, inp), operand in zip(shapes, kernel_operands):
                    kernel.call(inputs[inp], operand)
                seconds = time.perf_counter() - start
                key = (dtype, kernel.name, count)
                if round_index:
                    best[key] = min(best.get(key, float("inf")), seconds)
    return best


def build_report(args, machine, model_name, shapes, tokens, best) -> str:
    params = sum(out * inp for out, inp in shapes)
    lines = [
        *report_head("Linears by tokens: pdserve's panels against oneDNN's fp32 matmul", machine),
        (f"Weights: the decoder linears of `{model_name}` ({len(shapes)} matrices, "
         f"{params / 1e6:.1f} M parameters, no LM head); a round multiplies a [tokens, in] "
         f"input by each once. Best of {args.rounds} rounds, kernels interleaved; ms a round "
         "(GF/s). The ratios are each kind of panels' speed over oneDNN's."),
        "",
        "| tokens | " + " | ".join(f"{d} {k.name}" for d, k in KERNELS) + " | "
        + " | ".join(f"{d} panels / oneDNN" for d, _ in KERNELS[1:]) + " |",
        "|---" * (2 * len(KERNELS)) + "|",
    ]
    for count in tokens:
        cells = []
        for dtype, kernel in KERNELS:
            seconds = best[(dtype, kernel.name, count)]
            cells.append(f"{seconds * 1e3:.1f} ({2 * params * count / seconds / 1e9:.0f})")
        onednn = best[("fp32", KERNELS[0][1].name, count)]
        ratios = [onednn / best[(dtype, kernel.name, count)] for dtype, kernel in KERNELS[1:]]
        lines.append(
            f"| {count} | " + " | ".join(cells) + " | "
            + " | ".join(f"{r:.2f}x" for r in ratios) + " |"
        )
    lines += ["", f"Load average at end: {load_average()}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.linear_batches")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts to time"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run; writes nothing")
    parser.add_argument(
        "--output", type=Path, default=RESULTS / "linear_batches.md",
        help="the report (default bench/results/linear_batches.md; one file per machine kind)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path, shapes = model_weight_shapes(args.model)
    shapes = shapes[:-1]  # no LM head
    tokens = tuple(args.tokens)
    if args.quick:
        shapes, tokens, args.rounds = shapes[:4], tokens[:2], 1
    machine = machine_info()
    best = measure(shapes, tokens, args.rounds, args.seed)
    text = build_report(args, machine, model_path.name, shapes, tokens, best)
    print(text)
    if not args.quick:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
