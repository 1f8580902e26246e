"""The offline benchmark's markdown report: machine table, setup paragraph, throughput and
ratio tables against the targets, parity, batch-1 decode vs the memory-bandwidth floor, and
the profiler tables. Formatting only: every number comes in through `results`."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from pdserve.bench.bandwidth import Bandwidth, ReadRoofline
from pdserve.bench.decode_b1 import DecodeTiming
from pdserve.bench.profiling import ProfileSummary
from pdserve.bench.workload import Throughput

TARGET_VS_HF_BATCHED = 3.0
TARGET_VS_HF_SINGLE = 10.0
TARGET_ROOFLINE_FRACTION = 0.60  # batch-1 step >= 60% of the read roofline


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def throughput_section(runs: list[Throughput]) -> str:
    rows = [
        [
            run.name,
            str(run.num_requests),
            f"{run.useful_tokens:,}",
            f"{run.computed_tokens:,}",
            f"{run.seconds:.1f}",
            f"**{run.tokens_per_s:.1f}**",
        ]
        for run in runs
    ]
    header = ["system", "requests", "useful tokens", "computed tokens", "time (s)", "useful tok/s"]
    return md_table(header, rows)


def ratio_section(runs: list[Throughput]) -> str:
    ours, others = runs[0], runs[1:]
    targets = {"static batch": TARGET_VS_HF_BATCHED, "batch 1": TARGET_VS_HF_SINGLE}
    rows = []
    for other in others:
        target = next(t for key, t in targets.items() if key in other.name)
        ratio = ours.tokens_per_s / other.tokens_per_s
        verdict = "met" if ratio >= target else "NOT met"
        rows.append([f"pdserve / {other.name}", f"**{ratio:.2f}x**", f">= {target:g}x", verdict])
    return md_table(["ratio", "value", "target", ""], rows)


def decode_section(timing: DecodeTiming, weight_bytes: int, bandwidth: Bandwidth) -> str:
    """Floor = weight bytes / read bandwidth (the better of a streaming sum and a GEMV)."""
    roofline = ReadRoofline(weight_bytes, bandwidth)
    step, forward = timing.median_step_s, timing.median_forward_s
    fraction = roofline.fraction(step)
    verdict = "met" if roofline.meets(step, TARGET_ROOFLINE_FRACTION) else "NOT met"
    ms = 1e3
    rows = [
        ["weight bytes read per step", f"{weight_bytes / 1e6:.1f} MB"],
        ["streaming-read bandwidth (`sum` over 512 MiB) *", _gbs(bandwidth.sum_read)],
        ["GEMV read bandwidth (`mv` over a 512 MiB matrix) *", _gbs(bandwidth.gemv_read)],
        [
            "**read roofline** = weight bytes / the better of the two",
            f"**{roofline.floor_s * ms:.1f} ms** ({_gbs(bandwidth.read)})",
        ],
        [
            f"pdserve engine.step(), batch 1 (median of {len(timing.step_s)})",
            (
                f"**{step * ms:.1f} ms** (mean {statistics.mean(timing.step_s) * ms:.1f}, "
                f"min {min(timing.step_s) * ms:.1f})"
            ),
        ],
        [
            "  of which the forward (median)"
            + (": the compiled one-token step" if timing.compiled else ""),
            f"{forward * ms:.1f} ms",
        ],
        ["  engine overhead outside the forward", f"{(step - forward) * ms:.1f} ms"],
        [
            "  the model's linears alone, batch 1, back to back (best of 5)",
            f"{timing.linears_s * ms:.1f} ms ({_gbs(weight_bytes / timing.linears_s)})",
        ],
        [
            "  forward time outside the linears (attention, norms, rope, Python glue)",
            (
                f"{(forward - timing.linears_s) * ms:.1f} ms"
                if forward > timing.linears_s
                else "none left: the compiled forward is faster than its linears called alone"
            ),
        ],
        [
            "**achieved fraction** = read roofline / step time",
            (
                f"**{fraction:.0%}** (target >= {TARGET_ROOFLINE_FRACTION:.0%}: {verdict}); "
                f"linears alone: {roofline.fraction(timing.linears_s):.0%}"
            ),
        ],
    ]
    note = (
        "\n\n\\* fp32, best of 5, measured twice (start of the run and just before the batch-1 "
        "timing); the better of the two is shown."
    )
    return md_table(["batch-1 decode", "value"], rows) + note


def _gbs(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.1f} GB/s"


def profile_section(summary: ProfileSummary) -> str:
    phase_rows = [[label, f"{ms:.2f}"] for label, ms in summary.phases]
    op_rows = [
        [
            f"`{row.name}`",
            f"{row.self_ms_per_step:.2f}",
            f"{row.share:.1%}",
            f"{row.calls_per_step:g}",
        ]
        for row in summary.top_ops
    ]
    head = (
        f"#### {summary.title}\n\n{summary.num_steps} step(s), {summary.tokens_per_step:.0f} "
        f"tokens/step, {summary.wall_ms_per_step:.1f} ms/step wall under the profiler.\n\n"
    )
    phases = md_table(["phase (children included)", "CPU ms/step"], phase_rows)
    ops = md_table(["op (self CPU)", "ms/step", "share", "calls/step"], op_rows)
    return head + phases + "\n\n" + ops


def parity_section(lines: list[str]) -> str:
    summary = lines[0].removeprefix("parity: ")
    head = f"Parity of greedy tokens, pdserve vs transformers batch 1: {summary}"
    return "\n".join([head, *(f"- {line}" for line in lines[1:])]) + "\n"


def setup_paragraph(results: dict[str, Any], args: argparse.Namespace) -> str:
    quantization = getattr(args, "quantization", None)
    weights = f", pdserve's linear weights {quantization}" if quantization else ""
    return (
        f"Model: `{results['model']}` ({args.dtype}{weights}, "
        f"{results['weight_bytes'] / 1e6:.0f} MB of weights "
        f"read per decode step: every linear layer and norm, not the embedding table). "
        f"Workload: {args.num_requests} requests, seed {args.seed}, prompts "
        f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens ({results['prompt_tokens']:,} in all),"
        f" outputs {args.output_len[0]}-{args.output_len[1]} tokens, greedy, EOS ignored. "
        f"pdserve: max_num_batched_tokens {args.max_num_batched_tokens}, max_num_seqs "
        f"{args.max_num_seqs}, KV cache {args.kv_cache_gib:g} GiB, "
        f"{results['preemptions']} preemptions.\n"
    )


def build_report(results: dict[str, Any], args: argparse.Namespace) -> str:
    parts = [
        "# Offline throughput: pdserve vs transformers\n",
        f"Command: `{results['command']}`\n",
        md_table(["machine", ""], [[k, v] for k, v in results["machine"].items()]),
        "",
        setup_paragraph(results, args),
        "## Throughput (useful output tokens/s)\n",
        throughput_section(results["runs"]),
        "",
        ratio_section(results["runs"]) if len(results["runs"]) > 1 else "",
        "",
        parity_section(results["parity"]),
        "## Batch-1 decode vs the read roofline\n",
        decode_section(results["decode"], results["weight_bytes"], results["bandwidth"]),
        "",
    ]
    if results["profiles"]:
        parts.append("## Where pdserve's time goes (torch.profiler, CPU)\n")
        parts.append(
            "Phases are profiler ranges around the engine's parts (children included); "
            "`pd.*` rows in the op tables are the Python time of that phase outside any "
            "aten op. Profiler overhead inflates per-op Python time.\n"
        )
        parts += [profile_section(s) + "\n" for s in results["profiles"]]
    return "\n".join(parts).rstrip() + "\n"
