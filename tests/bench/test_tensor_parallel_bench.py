"""bench/tensor_parallel.py runs both engines on a tiny model and reports every row with its
ratio (the numbers themselves are the machine's)."""

from __future__ import annotations

from pdserve.bench.tensor_parallel import main


def test_the_report_compares_one_rank_with_two(tiny_llama_dir, tmp_path, capsys):
    output = tmp_path / "tp.md"
    main([
        "--model", str(tiny_llama_dir), "--threads", "2", "--prefill-tokens", "16",
        "--decode-tokens", "4", "--batch", "2", "--output", str(output),
    ])
    report = output.read_text()
    assert report == capsys.readouterr().out.rstrip("\n") + "\n"
    assert "| | TP 1 | TP 2 | TP 2 / TP 1 |" in report
    for row in ("prefill tokens/s", "decode tokens/s, batch 1", "decode tokens/s, batch 2"):
        assert f"| {row} |" in report
