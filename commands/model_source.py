"""The model `pdserve serve` serves: found and checked once, before any child process starts.

MODEL (`pdserve serve MODEL`, or `--model MODEL`) is a model folder, a Hugging Face Hub id
(`org/name`, fetched into or read from the Hub's cache: model_store/hub.py), or absent (the
default model, model_store/default_model.py). The folder must hold a config.json naming a
supported architecture, a tokenizer.json, and *.safetensors weights (unless `--load-format
dummy`); anything else is one ValueError naming what is missing, so the operator reads one line
instead of a traceback from every node.

`--tokenizer` (vLLM's) names another folder or Hub id whose tokenizer files (tokenizer.json,
tokenizer_config.json, the chat template) the router and the nodes read instead of the model
folder's; the weights stay MODEL's. A Hub id fetches those files alone. A tokenizer that cannot
be found or read is one ValueError naming `--tokenizer`.

Served names (what clients send as `model`): `--served-model-name`'s, the first of them listed
by /v1/models; else the folder's name for a folder, the id for a Hub id, the default model's name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServedModel:
    """`tokenizer_folder`: where the tokenizer is read from when not the model `folder`."""

    folder: Path
    names: tuple[str, ...]
    tokenizer_folder: Path | None = None


def resolve_served_model(
    model: str | None,
    served_names: list[str] | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    tokenizer: str | None = None,
) -> ServedModel:
    """ValueError when the model or the tokenizer cannot be found or fetched."""
    tokenizer_folder = (
        resolve_tokenizer_folder(tokenizer, download_dir) if tokenizer is not None else None
    )
    if model is None:
        from pdserve.model_store.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        folder, default_name = ensure_default_model(), DEFAULT_MODEL_NAME
    else:
        from pdserve.model_store.hub import HubModelUnavailable, hub_model_folder, is_hub_id

        if is_hub_id(model):
            try:
                folder = hub_model_folder(model, revision, download_dir)
            except HubModelUnavailable as error:
                raise ValueError(str(error)) from None
            default_name = model
        else:
            folder = Path(model).expanduser()
            default_name = folder.resolve().name or model
    names = tuple(served_names) if served_names else (default_name,)
    return ServedModel(folder, names, tokenizer_folder)


def resolve_tokenizer_folder(tokenizer: str, download_dir: str | None = None) -> Path:
    """`--tokenizer`'s folder, checked to hold a tokenizer that loads; for a Hub id, the
    snapshot of its tokenizer files. ValueError naming `--tokenizer` otherwise."""
    from pdserve.model_store.hub import (
        TOKENIZER_FILE_PATTERNS,
        HubModelUnavailable,
        download_hub_model,
        is_hub_id,
    )
    from pdserve.text.tokenizer import load_tokenizer

    if is_hub_id(tokenizer):
        try:
            folder = download_hub_model(
                tokenizer, cache_dir=download_dir, patterns=TOKENIZER_FILE_PATTERNS
            )
        except HubModelUnavailable as error:
            raise ValueError(f"--tokenizer {tokenizer}: {error}") from None
    else:
        folder = Path(tokenizer).expanduser()
        if not folder.is_dir():
            raise ValueError(
                f"--tokenizer {tokenizer}: no such folder (give a folder holding "
                "tokenizer.json, or a Hub id org/name)"
            )
    try:
        load_tokenizer(folder)
    except Exception as error:  # noqa: BLE001 (whatever the files hold: one line, not a trace)
        first_line = (str(error).strip().splitlines() or [repr(error)])[0]
        raise ValueError(f"--tokenizer {tokenizer}: cannot be read: {first_line}") from None
    return folder


def check_model_folder(
    folder: Path, load_format: str | None = None, own_tokenizer: bool = True
) -> None:
    """ValueError naming the first thing the nodes or the router would fail on;
    `own_tokenizer` False: the tokenizer comes from elsewhere (`--tokenizer`)."""
    from pdserve.engine.models import MODEL_REGISTRY

    if not folder.is_dir():
        raise ValueError(f"model folder {folder} does not exist (give a folder or an org/name id)")
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{folder} is not a model folder: it has no config.json") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"{config_path} cannot be read: {error}") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    architecture = architectures[0] if isinstance(architectures, list) and architectures else None
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"{config_path} names architecture {architecture!r}; pdserve serves "
            f"{', '.join(sorted(MODEL_REGISTRY))}"
        )
    if own_tokenizer and not (folder / "tokenizer.json").is_file():
        raise ValueError(
            f"{folder} has no tokenizer.json (the fast tokenizer file Hugging Face models ship)"
        )
    if load_format != "dummy" and not any(folder.glob("*.safetensors")):
        raise ValueError(
            f"{folder} has no *.safetensors weights (pdserve reads safetensors only; "
            "--load-format dummy serves random weights)"
        )
