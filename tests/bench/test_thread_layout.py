"""The thread-layout benchmark without servers: the layouts it starts for a core count, the
cores a process used from /proc, and a report row per layout with ratios to the disjoint one."""

from __future__ import annotations

import os

from pdserve.bench.thread_layout import build_report, cpu_seconds, layouts, parse_args


def test_layouts_compare_disjoint_shared_and_default_1p1d_with_colocated():
    flags = layouts(4)
    assert list(flags) == [
        "1P1D, 2+2 threads",
        "1P1D, 4+4 threads",
        "1P1D default: 2+2, decode borrows 4 while prefill idles",
        "colocated, 4 threads",
    ]
    assert flags["1P1D default: 2+2, decode borrows 4 while prefill idles"] == [
        "--prefill", "1", "--decode", "1",
    ]


def test_cpu_seconds_of_this_process_grow_and_a_gone_process_has_none():
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert cpu_seconds(os.getpid()) > before
    assert cpu_seconds(2**22 + 12345) == 0.0


def summary(tok_s: float, ttft: float, itl: float) -> dict:
    return {
        "completed": 4, "requests": 4, "throughput_tok_s": tok_s, "ttft_p50": ttft,
        "ttft_p99": ttft, "tpot_p50": itl, "itl_p50": itl, "itl_p99": 2 * itl,
        "cores": {"decode-0": 1.9, "prefill-0": 0.02, "router": 0.03},
    }


def test_the_report_has_a_row_per_layout_and_ratios_to_the_disjoint_layout():
    args = parse_args([])
    by_layout = {
        name: {"w": summary(tok_s, 0.1, 0.04)}
        for name, tok_s in zip(layouts(2), (20.0, 30.0, 32.0, 33.0))
    }
    text = build_report(args, {"cpu": "test"}, by_layout, ["w"])
    assert text.count("| 1P1D") == 3 and "| colocated, 2 threads |" in text
    assert "decode 1.90, prefill 0.02 (router 0.03)" in text
    assert "- 1P1D, 2+2 threads / 1P1D, 1+1 threads: output tok/s 1.50x" in text
    assert "decode borrows 2 while prefill idles / 1P1D, 1+1 threads: output tok/s 1.60x" in text
