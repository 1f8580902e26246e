"""bench/offline.py runs pdserve and transformers in one dtype: `--dtype auto` is the dtype
pdserve's own `--dtype auto` picks on this machine, and an explicit one is taken as given."""

from __future__ import annotations

import torch

from pdserve.bench.offline import parse_args, resolve_dtype
from pdserve.engine.cpu.dtype_choice import choose_dtype


def test_auto_is_the_engines_choice_on_this_cpu_and_explicit_dtypes_are_kept():
    assert parse_args([]).dtype == "auto"
    assert resolve_dtype("auto") == choose_dtype(None, torch.device("cpu"), None).dtype
    assert resolve_dtype("float32") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16


def test_int8_weights_run_in_float32_unless_asked_otherwise_and_the_report_says_so():
    from pdserve.bench.report import setup_paragraph

    args = parse_args(["--quantization", "int8"])
    assert args.quantization == "int8" and parse_args([]).quantization is None
    assert resolve_dtype("auto", "int8") == torch.float32
    assert resolve_dtype("bfloat16", "int8") == torch.bfloat16
    args.dtype = "float32"
    results = {"model": "m", "weight_bytes": 135e6, "prompt_tokens": 10, "preemptions": 0}
    text = setup_paragraph(results, args)
    assert text.startswith("Model: `m` (float32, pdserve's linear weights int8, 135 MB of weights")
