"""Triton kernels on a CUDA GPU against the memory-bandwidth bound, with Llama-3-8B shapes.

What it measures (bf16, 32 query heads, 8 KV heads, head dim 128, blocks of 16 tokens):

1. Copy bandwidth: ``dst.copy_(src)`` of a large tensor (``--copy-gib``), counted as bytes
   read + bytes written per second (the GPU STREAM-copy convention; half of it is also printed).
2. Decode attention (one layer, split-KV paged kernel) at every ``--batches`` x ``--contexts``:
   bytes it must read (every key and value of every sequence, plus queries, outputs and block
   tables) / time, as a fraction of the copy bandwidth. Blocks are a random permutation, as a
   busy cache's are. Target: >= 70% at batch >= 32.
3. The full decode step of a Llama-3-8B-shaped model (the engine's LlamaForCausalLM, random
   weights made on the GPU, triton attention) at ``--step-batches`` with ``--step-context``
   tokens of context, eager and replayed from a CUDA graph, against the floor
   ``weight bytes / copy bandwidth`` (every weight read once; the KV bytes are shown beside).
   The step is the backend's per-step metadata plus the model forward (the graph path: its
   buffer copies plus the replay); the sampler is not included. Target: >= 85% at batch 1.

Times are medians of ``triton.testing.do_bench`` (which flushes the L2 cache between runs).

    python -m pdserve.bench.kernels                 # everything (a few minutes; ~40 GB of GPU
    memory)
    python -m pdserve.bench.kernels --skip-step     # attention only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

from pdserve.bench.machine import command_line, machine_info

GIB = 2**30
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS, BLOCK_SIZE = 32, 8, 128, 32, 16
DTYPE = torch.bfloat16
ATTENTION_TARGET, ATTENTION_TARGET_MIN_BATCH = 0.70, 32
STEP_TARGET, STEP_TARGET_BATCH = 0.85, 1
LLAMA_3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": NUM_HEADS,
    "num_key_value_heads": NUM_KV_HEADS,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--step-batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--step-context", type=int, default=1024)
    parser.add_argument("--copy-gib", type=float, default=4.0)
    parser.add_argument("--skip-step", action="store_true", help="attention only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/kernels.md")
    return parser.parse_args(argv)


def median_seconds(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def gpu_info(device: torch.device) -> dict[str, str]:
    import triton

    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": f"{props.name}, {props.total_memory / GIB:.0f} GiB, "
        f"{props.multi_processor_count} SMs",
        "cuda": f"{torch.version.cuda}, triton {triton.__version__}",
    }


def copy_bandwidth(device: torch.device, gib: float) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    src = torch.empty(int(gib * GIB), dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * gib * GIB / median_seconds(lambda: dst.copy_(src))


@dataclass
class AttentionRun:
    batch: int
    context: int
    num_splits: int
    kv_bytes: int
    seconds: float
    bytes_read: int


def bench_attention(batch: int, context: int, device: torch.device) -> AttentionRun:
    from pdserve.kernels.decode_attention import decode_attention, plan_splits

    generator = torch.Generator(device=device).manual_seed(batch * context)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    key_cache = torch.randn(shape, generator=generator, device=device, dtype=DTYPE)
    value_cache = torch.randn(shape, generator=generator, device=device, dtype=DTYPE)
    order = torch.randperm(num_blocks, generator=generator, device=device)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=generator, device=device, dtype=DTYPE)
    out = torch.empty_like(q)
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    plan = plan_splits(batch, NUM_KV_HEADS, context, processors)

    def run() -> None:
        decode_attention(
            q, key_cache, value_cache, block_tables, seq_lens, HEAD_DIM**-0.5, out=out, plan=plan
        )

    seconds = median_seconds(run)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * key_cache.element_size()
    bytes_read = kv_bytes + 2 * q.numel() * q.element_size() + block_tables.numel() * 4
    return AttentionRun(batch, context, plan.num_splits, kv_bytes, seconds, bytes_read)


@dataclass
class StepRun:
    batch: int
    context: int
    weight_bytes: int
    kv_bytes: int
    eager_seconds: float
    graph_seconds: float


def build_model(device: torch.device, max_positions: int) -> torch.nn.Module:
    """The engine's Llama with Llama-3-8B shapes and random bf16 weights made on the GPU."""
    from transformers import LlamaConfig

    from pdserve.engine.model_config import ModelConfig
    from pdserve.engine.models import model_class

    with tempfile.TemporaryDirectory() as folder:
        LlamaConfig(architectures=["LlamaForCausalLM"], **LLAMA_3_8B).save_pretrained(folder)
        config = ModelConfig.from_folder(folder)
    with torch.device(device):
        model = model_class(config)(config, max_positions)
    model.to(dtype=DTYPE)
    model.rotary.to(dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:  # matrices and the embedding; norms keep their ones
                parameter.normal_(0.0, 0.02)
    return model.eval().requires_grad_(False)


def bench_steps(batches: list[int], context: int, device: torch.device) -> list[StepRun]:
    from pdserve.engine.attention.triton_backend import TritonAttentionBackend
    from pdserve.engine.batch import build_flat_batch
    from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
    from pdserve.engine.runner.cuda_graphs import DecodeGraphs

    max_positions = context + 1
    model = build_model(device, max_positions)
    blocks_per_seq = -(-max_positions // BLOCK_SIZE)
    spec = KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE)
    kv_cache = KVCache(spec, max(batches) * blocks_per_seq, device)
    backend = TritonAttentionBackend(kv_cache, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, None)
    with torch.inference_mode():
        graphs = DecodeGraphs(model, backend, max(batches), max_positions, BLOCK_SIZE, device)
    runs = []
    for batch_size in batches:
        tables = [
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch_size)
        ]
        batch = build_flat_batch(
            token_chunks=[[i + 1] for i in range(batch_size)],
            context_lens=[context] * batch_size,
            block_tables=tables,
            sample_flags=[True] * batch_size,
            block_size=BLOCK_SIZE,
            device=device,
        )

        @torch.inference_mode()
        def eager(batch=batch) -> torch.Tensor:
            metadata = backend.prepare(batch)
            return model(batch.input_ids, batch.positions, batch.logits_indices, backend, metadata)

        @torch.inference_mode()
        def replay(batch=batch) -> torch.Tensor:
            return graphs.run(batch)

        torch.testing.assert_close(replay().float(), eager().float(), atol=0.1, rtol=0.05)
        kv_bytes = spec.bytes_per_block // BLOCK_SIZE * batch_size * (context + 1)
        runs.append(
            StepRun(
                batch=batch_size,
                context=context,
                weight_bytes=model.decode_weight_bytes(),
                kv_bytes=kv_bytes,
                eager_seconds=median_seconds(eager),
                graph_seconds=median_seconds(replay),
            )
        )
    return runs


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def verdict(value: float, target: float, applies: bool) -> str:
    if not applies:
        return "-"
    return "met" if value >= target else "NOT met"


def report(command: str, machine: dict[str, str], bandwidth: float, attention, steps) -> str:
    parts = [
        "# Triton kernels vs memory bandwidth (Llama-3-8B shapes, bf16)",
        f"Command: `{command}`",
        table(["machine", ""], [[k, v] for k, v in machine.items()]),
        (
            f"Copy bandwidth (`dst.copy_(src)`, read + written): **{bandwidth / 1e9:,.0f} GB/s** "
            f"({bandwidth / 2e9:,.0f} GB/s counted as bytes copied)."
        ),
        "## Decode attention (one layer: 32 query heads over 8 KV heads, head dim 128)",
        table(
            ["batch", "context", "splits", "KV MiB", "time (us)", "achieved GB/s",
             "of copy bandwidth",
             f"target >= {ATTENTION_TARGET:.0%} at batch >= {ATTENTION_TARGET_MIN_BATCH}"],
            [
                [
                    str(run.batch), f"{run.context:,}", str(run.num_splits),
                    f"{run.kv_bytes / 2**20:,.0f}", f"{run.seconds * 1e6:,.1f}",
                    f"{run.bytes_read / run.seconds / 1e9:,.0f}",
                    f"**{run.bytes_read / run.seconds / bandwidth:.0%}**",
                    verdict(
                        run.bytes_read / run.seconds / bandwidth, ATTENTION_TARGET,
                        run.batch >= ATTENTION_TARGET_MIN_BATCH,
                    ),
                ]
                for run in attention
            ],
        ),
    ]
    if steps:
        rows = []
        for run in steps:
            floor = run.weight_bytes / bandwidth
            for name, seconds in (("eager", run.eager_seconds), ("CUDA graph", run.graph_seconds)):
                rows.append([
                    str(run.batch), name, f"{run.weight_bytes / 1e9:.2f}",
                    f"{run.kv_bytes / 1e9:.3f}", f"{seconds * 1e3:.2f}", f"{floor * 1e3:.2f}",
                    f"**{floor / seconds:.0%}**",
                    verdict(floor / seconds, STEP_TARGET, run.batch == STEP_TARGET_BATCH),
                ])
        parts += [
            (
                f"## Decode step of a Llama-3-8B-shaped model ({steps[0].context:,} tokens of "
                "context per sequence)"
            ),
            table(
                ["batch", "mode", "weight GB", "KV GB", "step (ms)", "floor (ms)",
                 "floor / step", f"target >= {STEP_TARGET:.0%} at batch {STEP_TARGET_BATCH}"],
                rows,
            ),
        ]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "pdserve.bench.kernels measures Triton kernels on a CUDA GPU, and this machine has "
            "none "
            f"(torch {torch.__version__}: torch.cuda.is_available() is False). Nothing was "
            "measured. Run `python -m pdserve.bench.kernels` on a machine with an NVIDIA GPU.",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    command = command_line()
    machine = {**machine_info(), **gpu_info(device)}
    print(f"command: {command}\nmachine: {machine}", flush=True)
    bandwidth = copy_bandwidth(device, args.copy_gib)
    print(f"copy bandwidth: {bandwidth / 1e9:,.0f} GB/s (read + written)", flush=True)
    attention = []
    for batch in args.batches:
        for context in args.contexts:
            attention.append(bench_attention(batch, context, device))
            torch.cuda.empty_cache()
            run = attention[-1]
            print(
                f"attention batch {batch} context {context}: {run.seconds * 1e6:,.1f} us, "
                f"{run.bytes_read / run.seconds / bandwidth:.0%} of copy bandwidth",
                flush=True,
            )
    steps = [] if args.skip_step else bench_steps(args.step_batches, args.step_context, device)
    text = report(command, machine, bandwidth, attention, steps)
    print("\n" + text, flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"report written to {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
