"""The sweep's flags and report without servers: configuration names, ratios against
colocated, a configuration whose server did not start, and the plot file."""

from __future__ import annotations

import pytest

from pdserve.bench.serve_load import RequestTiming, summarize
from pdserve.bench.sweep import CONFIGS, parse_args
from pdserve.bench.sweep_report import build_report, plot


def _summary(ttft: float, n_good: int) -> dict:
    timings = [
        RequestTiming("x", ok=True, ttft=ttft, e2e=ttft + 0.4, output_tokens=5, itls=[0.1] * 4)
        for _ in range(n_good)
    ]
    timings.append(RequestTiming("x", ok=True, ttft=99.0, e2e=99.4, output_tokens=5))
    return summarize(timings, wall=10.0, slo_ttft=3.0, slo_tpot=0.15)


def test_quick_flags_pick_two_configs_one_rate_and_a_small_dataset():
    args = parse_args(["--quick", "--out-dir", "somewhere"])
    assert args.configs == ["colocated", "1p1d"] and args.rates == [1.0]
    assert args.dataset == "shared-prefix" and args.prefix_len == 128
    assert args.out_dir == "somewhere"
    assert "--no-enable-prefix-caching" in CONFIGS["1p1d-no-prefix-cache"]


def test_unknown_config_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--configs", "colocated,3p3d"])
    assert "choose from colocated, 1p1d, 2p1d" in capsys.readouterr().err


def test_report_has_a_row_per_config_with_ratios_against_colocated(tmp_path):
    args = parse_args(["--configs", "colocated,1p1d,2p1d", "--rates", "1,2"])
    results = {
        "colocated": {1.0: _summary(1.0, 3), 2.0: _summary(2.0, 1)},
        "1p1d": {1.0: _summary(0.5, 3), 2.0: _summary(1.0, 4)},
        "2p1d": None,
    }
    flags = {name: CONFIGS[name] for name in args.configs}
    text = build_report(args, {"cpu": "test"}, results, {1.0: [0] * 4, 2.0: [0] * 4}, flags)
    assert "## 1 requests/s" in text and "## 2 requests/s" in text
    assert "| 2p1d | server did not start |" in text
    assert "| 1p1d | 5/5 | **0.400** |" in text  # 4 of 5 requests within the SLO in 10 s
    assert "| 4.00x |" in text  # 0.4 vs colocated's 0.1 at 2 requests/s
    assert "`pdserve serve --prefill 2 --decode 1`" in text
    plot(args, results, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 1000
