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
