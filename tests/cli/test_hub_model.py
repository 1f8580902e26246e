"""Hub ids resolve through the Hugging Face cache, offline; without a cached copy `pdserve serve`
says so in one line and exits 2 before any child process starts. No test reaches the Hub: each
builds the cache's layout (`models--org--name/snapshots/REV/...`, `refs/main`) itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.commands.model_source import check_model_folder, resolve_served_model
from pdserve.model_store.hub import HubModelUnavailable, download_hub_model, is_hub_id
from pdserve.wire.free_ports import free_port

REVISION = "0123456789abcdef0123456789abcdef01234567"


def cached_hub_model(hub_cache: Path, repo_id: str, source: Path) -> Path:
    """`source`'s files as the Hub's cache holds `repo_id` at main."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def offline_env(hub_cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}


def test_hub_ids_are_org_slash_name_that_no_local_path_has(tmp_path):
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_hub_id("model")
    assert not is_hub_id("/abs/path")
    assert not is_hub_id("./org/name")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id(os.path.relpath(tmp_path / "org" / "name"))


def test_a_cached_hub_model_resolves_offline_to_its_snapshot(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = cached_hub_model(tmp_path / "hub", "org/tiny", tiny_llama_dir)
    assert download_hub_model("org/tiny", cache_dir=tmp_path / "hub") == snapshot
    served = resolve_served_model("org/tiny", None, None, str(tmp_path / "hub"))
    assert served == type(served)(snapshot, ("org/tiny",))
    check_model_folder(served.folder)


def test_an_uncached_hub_model_offline_is_one_error_that_says_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubModelUnavailable) as error:
        download_hub_model("org/missing", cache_dir=tmp_path / "hub")
    message = str(error.value)
    assert "org/missing is not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE is set" in message and "pdserve download org/missing" in message
    assert "\n" not in message


def test_pdserve_download_prints_the_cached_snapshot(tmp_path, tiny_llama_dir):
    snapshot = cached_hub_model(tmp_path / "hub", "org/tiny", tiny_llama_dir)
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "download", "org/tiny"],
        capture_output=True, text=True, timeout=60, check=False, env=offline_env(tmp_path / "hub"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(snapshot)


def test_serve_without_network_or_cached_copy_exits_2_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "serve", "org/missing",
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, check=False, env=offline_env(tmp_path / "hub"),
    )
    assert result.returncode == 2
    assert result.stdout == ""  # not even the log folder: no child process started
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pdserve: model org/missing is not in the Hugging Face cache")


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("no_config", "has no config.json"),
        ("architecture", "names architecture 'GPT2LMHeadModel'; pdserve serves"),
        ("no_tokenizer", "has no tokenizer.json"),
        ("no_weights", "has no *.safetensors weights"),
    ],
)
def test_a_model_folder_is_checked_once_with_one_line(tmp_path, tiny_llama_dir, breakage, message):
    folder = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    if breakage == "no_config":
        (folder / "config.json").unlink()
    elif breakage == "architecture":
        text = (folder / "config.json").read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel")
        (folder / "config.json").write_text(text)
    elif breakage == "no_tokenizer":
        (folder / "tokenizer.json").unlink()
    else:
        for weights in folder.glob("*.safetensors"):
            weights.unlink()
    with pytest.raises(ValueError, match=re.escape(message)):
        check_model_folder(folder)
    if breakage == "no_weights":
        check_model_folder(folder, load_format="dummy")


@pytest.mark.default_model
def test_the_default_models_hub_id_without_the_hub_is_pdserves_own_copy(
    tmp_path, default_model_dir, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "download",
         "HuggingFaceTB/SmolLM2-135M-Instruct"],
        capture_output=True, text=True, timeout=120, check=False,
        env=offline_env(tmp_path / "hub"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(default_model_dir)
    assert "serving pdserve's own copy of HuggingFaceTB/SmolLM2-135M-Instruct" in result.stderr
    served = resolve_served_model("HuggingFaceTB/SmolLM2-135M-Instruct", None, None,
                                  str(tmp_path / "hub"))
    assert served.folder == default_model_dir
    assert served.names == ("HuggingFaceTB/SmolLM2-135M-Instruct",)
    with pytest.raises(ValueError, match="revision"):  # another revision is not the same copy
        resolve_served_model("HuggingFaceTB/SmolLM2-135M-Instruct", None, "v0.1",
                             str(tmp_path / "hub"))
