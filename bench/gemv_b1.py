"""Batch-1 matrix-vector products over a model's weight shapes: how fast each of torch's CPU
kernels reads the weights of a decode step, against the machine's read bandwidth.

A round multiplies a [1, in] vector by every linear weight of the model once, layer after layer,
then the LM head: the bytes a batch-1 decode step streams, far more than any cache holds, so each
weight comes from memory as in a real step. Every kernel runs one round in turn (fp32 F.linear, fp32
prepacked, bf16 F.linear, bf16 prepacked where oneDNN packs bf16, bf16 torch.mv, ...), and each
number is the best of `--rounds` interleaved rounds: on a shared small machine another process's
burst stalls whichever kernel it overlaps, and interleaving spreads that over all of them.

Candidates beside torch's own kernels: pdserve's one-token bf16 kernel (kernels/cpu_gemv.py:
AVX512-BF16 dot products, compiled by numba; the engine's batch-1 path on CPUs that have the
instruction), an earlier bf16 GEMV compiled by numba (each weight word widened to fp32 by a shift
and a bit cast inside the multiply-add loop), and int8 weight-only
(`torch.ops.aten._weight_int8pack_mm`, per-row scales: half the bytes of bf16).

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

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.bench.bandwidth import measure_bandwidth
from pdserve.bench.machine import load_average, machine_info, report_head
from pdserve.engine.cpu.cpu_features import onednn_packs_bf16

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Kernel:
    name: str
    dtype: torch.dtype  # of the weight bytes the kernel reads
    prepare: Callable[[torch.Tensor], object]  # the weight [out, in] -> its operand
    call: Callable[[torch.Tensor, object], torch.Tensor]  # (x [1, in], operand)
    given_dtype: torch.dtype | None = None  # of x and the weight handed over (None: dtype)

    @property
    def input_dtype(self) -> torch.dtype:
        return self.given_dtype or self.dtype


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _packed_call(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 and the bf16 scales `_weight_int8pack_mm` takes."""
    scales = weight.float().abs().amax(dim=1).clamp(min=1e-8) / 127
    codes = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales.to(torch.bfloat16)


def _int8_call(x: torch.Tensor, operand: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, *operand)


def _numba_gemv() -> Callable | None:
    """A bf16 GEMV compiled by numba, or None where numba is missing."""
    try:
        import numba
        from llvmlite import ir
        from numba import njit, prange, types
        from numba.extending import intrinsic
    except ImportError:
        return None

    @intrinsic
    def as_float32(typingctx, word):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.uint32), codegen

    @njit(parallel=True, fastmath={"reassoc", "contract"}, boundscheck=False)
    def gemv(x, words, out, num_chunks):
        rows, cols = words.shape
        per_chunk = (rows + num_chunks - 1) // num_chunks
        for chunk in prange(num_chunks):
            for row in range(chunk * per_chunk, min(rows, (chunk + 1) * per_chunk)):
                total = np.float32(0.0)
                for col in range(cols):
                    total += x[col] * as_float32(np.uint32(words[row, col]) << np.uint32(16))
                out[row] = total

    numba.set_num_threads(torch.get_num_threads())
    threads = torch.get_num_threads()

    def call(x: torch.Tensor, operand: tuple) -> torch.Tensor:
        words, out = operand
        gemv(x[0].float().numpy(), words, out, threads)
        return torch.from_numpy(out)

    return call


def _numba_operand(weight: torch.Tensor) -> tuple:
    words = weight.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return words, np.empty(weight.shape[0], np.float32)


def _pdserve_operand(weight: torch.Tensor) -> tuple:
    from pdserve.kernels.cpu_gemv import bf16_words

    bf16 = weight.to(torch.bfloat16).contiguous()
    return bf16, bf16_words(bf16), bf16_words(torch.zeros(0, dtype=torch.bfloat16))


def _pdserve_call(x: torch.Tensor, operand: tuple) -> torch.Tensor:
    from pdserve.kernels.cpu_gemv import gemv_bf16

    return gemv_bf16(x, operand[1], operand[2])


def _int8_weight(weight: torch.Tensor) -> object:
    from pdserve.engine.layers.int8_weight import Int8Weight

    return Int8Weight.quantize(weight, None)


def kernels() -> list[Kernel]:
    """Every kernel this machine can run, in the order of a round."""
    found = [
        Kernel("F.linear", torch.float32, lambda w: w, lambda x, w: F.linear(x, w)),
        Kernel("torch.mv", torch.float32, lambda w: w, lambda x, w: torch.mv(w, x[0])),
        Kernel("F.linear", torch.bfloat16, lambda w: w, lambda x, w: F.linear(x, w)),
        Kernel("torch.mv", torch.bfloat16, lambda w: w, lambda x, w: torch.mv(w, x[0])),
    ]
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        found.insert(1, Kernel("oneDNN prepacked", torch.float32, _packed, _packed_call))
        if onednn_packs_bf16():  # it refuses to pack bf16 on an AVX2-only CPU
            found.insert(4, Kernel("oneDNN prepacked", torch.bfloat16, _packed, _packed_call))
    from pdserve.kernels.cpu_gemv import cpu_gemv_available

    if cpu_gemv_available():
        found.append(
            Kernel("pdserve one-token (AVX512-BF16)", torch.bfloat16, _pdserve_operand, _pdserve_call)
        )
    numba_call = _numba_gemv()
    if numba_call is not None:
        found.append(Kernel("numba, widened in the loop", torch.bfloat16, _numba_operand, numba_call))
    from pdserve.kernels.cpu_int8_linear import int8_kernel_available

    if int8_kernel_available():  # --quantization int8 (engine/layers/int8_weight.py)
        found.append(
            Kernel("pdserve int8 (x in fp32)", torch.int8, _int8_weight, lambda x, w: w(x),
                   torch.float32)
        )
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        found.append(
            Kernel("int8 weight-only (x in bf16)", torch.int8, _int8_rows, _int8_call, torch.bfloat16)
        )
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


def model_weight_shapes(model: str | None) -> tuple[Path, list[tuple[int, int]]]:
    """The model's folder (the default model's when None) and `model_shapes` of its config."""
    if model is None:
        from pdserve.model_store.default_model import ensure_default_model

        model_path = ensure_default_model()
    else:
        model_path = Path(model)
    return model_path, model_shapes(json.loads((model_path / "config.json").read_text()))


@torch.inference_mode()
def measure(shapes: list[tuple[int, int]], rounds: int, seed: int) -> list[tuple[Kernel, float]]:
    """Best round time of each kernel, rounds interleaved across kernels."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(out, inp, generator=generator) * 0.02 for out, inp in shapes]
    prepared = []
    for kernel in kernels():
        operands = [kernel.prepare(w.to(kernel.input_dtype)) for w in weights]
        inputs = [
            torch.randn(1, inp, generator=generator).to(kernel.input_dtype) for _, inp in shapes
        ]
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
        *report_head("Batch-1 matrix-vector products: torch's CPU kernels vs the read bandwidth", machine),
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
        nbytes = params * torch.empty((), dtype=kernel.dtype).element_size()
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
    parser.add_argument(
        "--output", type=Path, default=RESULTS / "gemv_b1.md",
        help="the report (default bench/results/gemv_b1.md; one file per machine kind)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path, shapes = model_weight_shapes(args.model)
    if args.quick:
        shapes, args.rounds = shapes[:4] + shapes[-1:], 1
    machine = machine_info()
    bandwidth = measure_bandwidth()
    timings = measure(shapes, args.rounds, args.seed)
    bandwidth = bandwidth.best_of(measure_bandwidth())
    text = build_report(args, machine, model_path.name, shapes, bandwidth, timings)
    print(text)
    if not args.quick:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
