"""The GPU machine's own Python packages, mirrored on a CPU for `make gpu-dryrun`: a virtual
environment holding only the packages of that machine's image that `make gpu-check` uses (and
what pip installs with them), at the image's versions where they are known. Never pdserve's own
dependency list: what the image lacks comes from the wheels of `make gpu-wheels`, which the dry
run installs itself, offline, as the GPU check does.

    python -P bench/gpu_image_venv.py .gpu-dryrun/venv

The image runs Python 3.12 with a CUDA build of torch. A version that pip has no build of for
this Python is replaced by the newest one older than it, and torch by a CPU build (the image's
version where pip has one, else the newest CPU build pip has): each replacement is printed.
Newer releases of their dependencies than the image holds can bring distributions the image
does not have (typer pulls in pydantic): those are uninstalled again, since the check cannot
count on them there. A venv built before from the same lists and Python is reused once its
versions are verified; otherwise it is built afresh. Standard library only: it runs before the
venv exists.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

IMAGE_PYTHON = "3.12"
# The image's packages that `make gpu-check` imports, with the version its `pip list` showed
# where one was read (None: not read; the newest pip has is taken).
IMAGE_PACKAGES: dict[str, str | None] = {
    "torch": "2.11.0",
    "triton": "3.6.0",
    "transformers": "5.17.0",
    "numpy": "2.5.2",
    "tokenizers": "0.23.2",
    "safetensors": "0.8.0",
    "huggingface-hub": "1.33.0",
    "numba": None,
    "llvmlite": None,
    "msgpack": None,
    "uvloop": None,
    "anyio": None,
    "h11": None,
    "httpx": None,
    "prometheus-client": None,
    "jinja2": None,
    "tqdm": None,
    "pytest": None,
    "pytest-xdist": None,
    "hypothesis": None,
}
# Every distribution of the image, as read there (pip's names, canonical form).
IMAGE_DISTRIBUTIONS = frozenset((
    "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal",
    "annotated-doc", "anyio", "attrs", "botorch", "build", "certifi", "charset-normalizer", "chex",
    "click", "cloudpickle", "cmake", "colorama", "contourpy", "coverage", "cuda-bindings",
    "cuda-core", "cuda-pathfinder", "cuda-toolkit", "cupy-cuda13x", "cycler", "cython", "diffrax",
    "e3nn", "einops", "equinox", "etils", "execnet", "filelock", "flatbuffers", "flax",
    "fonttools", "formulaic", "frozenlist", "fsspec", "gpytorch", "grpcio", "h11", "h5py",
    "hf-xet", "httpcore", "httpx", "huggingface-hub", "humanize", "hypothesis", "idna", "imageio",
    "iniconfig", "interface-meta", "jax", "jax-cuda13-pjrt", "jax-cuda13-plugin", "jaxlib",
    "jaxtyping", "jinja2", "joblib", "kiwisolver", "lazy-loader", "lightning",
    "lightning-utilities", "linear-operator", "lineax", "llvmlite", "lxml", "markdown",
    "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "meson", "ml-dtypes", "mpi4py",
    "mpmath", "msgpack", "multidict", "multipledispatch", "mypy-extensions", "nanobind",
    "narwhals", "networkx", "ninja", "numba", "numba-cuda", "numpy", "numpyro", "nvidia-cublas",
    "nvidia-cuda-cupti", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13",
    "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse",
    "nvidia-cusparselt-cu13", "nvidia-ml-py", "nvidia-nccl-cu13", "nvidia-nvjitlink",
    "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx", "onnx-ir", "onnxruntime", "onnxscript",
    "opencv-python-headless", "optax", "opt-einsum", "opt-einsum-fx", "optimistix",
    "orbax-checkpoint", "packaging", "pandas", "pathspec", "patsy", "peft", "pillow", "pip",
    "pluggy", "portalocker", "prometheus-client", "propcache", "protobuf", "psutil", "pyarrow",
    "pybind11", "py-cpuinfo", "pygments", "pyparsing", "pyproject-hooks", "pyre-extensions",
    "pytest", "pytest-benchmark", "pytest-cov", "pytest-mock", "pytest-timeout", "pytest-xdist",
    "python-dateutil", "pytorch-lightning", "pyyaml", "regex", "requests", "rich", "sacrebleu",
    "safetensors", "scikit-build-core", "scikit-image", "scikit-learn", "scipy", "seaborn",
    "sentencepiece", "sentence-transformers", "setuptools", "shellingham", "simplejson", "six",
    "sortedcontainers", "statsmodels", "sympy", "tabulate", "tensorboard",
    "tensorboard-data-server", "tensorstore", "threadpoolctl", "tifffile", "tiktoken", "timm",
    "tokenizers", "toolz", "torch", "torchaudio", "torchdiffeq", "torch-geometric", "torchmetrics",
    "torchvision", "tqdm", "transformers", "treescope", "triton", "typer", "typing-extensions",
    "typing-inspect", "urllib3", "uvloop", "wadler-lindig", "werkzeug", "wheel", "wrapt", "xarray",
    "xxhash", "yarl", "zipp",
))
CPU_BUILD = "+cpu"
STAMP_NAME = "pdserve-gpu-image.json"
PIP_TIMEOUT_S = 900


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version: (2, 13, 0) for "2.13.0+cpu"."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0].split("rc")[0]))


def available_versions(python: Path, name: str) -> list[str]:
    """The versions of `name` pip can install for `python`, newest first."""
    found = subprocess.run(
        [str(python), "-m", "pip", "index", "versions", name],
        capture_output=True, text=True, timeout=120, check=False,
    )
    for line in found.stdout.splitlines():
        if line.startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    raise SystemExit(
        f"gpu-image-venv: pip lists no version of {name} for {python} "
        f"(exit {found.returncode}): {found.stderr.strip()[-400:]}"
    )


def chosen_version(python: Path, name: str, image_version: str) -> tuple[str, str]:
    """(the version to install, a note when it is not the image's)."""
    versions = available_versions(python, name)
    if name == "torch":
        cpu_builds = [v for v in versions if v.endswith(CPU_BUILD)]
        if image_version + CPU_BUILD in cpu_builds:
            return image_version + CPU_BUILD, ""
        if not cpu_builds:
            raise SystemExit(
                f"gpu-image-venv: pip has no CPU build of torch here (versions: {versions[:8]})"
            )
        return cpu_builds[0], f"pip has no CPU build of the image's {image_version}"
    if image_version in versions:
        return image_version, ""
    older = [v for v in versions if release(v) < release(image_version)]
    if not older:
        raise SystemExit(
            f"gpu-image-venv: pip has no {name} at or below the image's {image_version} for "
            f"Python {platform.python_version()} (versions: {versions[:8]})"
        )
    return older[0], f"pip has no build of the image's {image_version} for this Python"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def not_in_the_image(python: Path) -> list[str]:
    """The distributions of `python`'s venv that the image does not have."""
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return sorted(
        d["name"] for d in json.loads(listed.stdout)
        if canonical(d["name"]) not in IMAGE_DISTRIBUTIONS
    )


def drop_what_the_image_lacks(python: Path) -> list[str]:
    """Uninstalls every distribution of the venv that the image does not have; their names."""
    extra = not_in_the_image(python)
    if extra:
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "-y", "-q", "--disable-pip-version-check",
             *extra], timeout=120, check=True,
        )
    return extra


def installed_versions(python: Path, names: list[str]) -> dict[str, str | None]:
    """Each distribution's installed version in `python`'s environment (None: not there)."""
    script = (
        "import importlib.metadata as m, json, sys\n"
        "def version(name):\n"
        "    try:\n"
        "        return m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        return None\n"
        "print(json.dumps({n: version(n) for n in sys.argv[1:]}))\n"
    )
    listed = subprocess.run(
        [str(python), "-c", script, *names], capture_output=True, text=True, timeout=60,
        check=True,
    )
    return json.loads(listed.stdout)


def reusable(venv: Path, python: Path) -> bool:
    """The venv was built from this list for this Python, and still holds what it installed."""
    stamp = venv / STAMP_NAME
    if not stamp.exists() or not python.exists():
        return False
    built = json.loads(stamp.read_text(encoding="utf-8"))
    if built.get("python") != platform.python_version() or built.get("image") != IMAGE_PACKAGES:
        return False
    if built.get("image_distributions") != sorted(IMAGE_DISTRIBUTIONS):
        return False
    if installed_versions(python, list(IMAGE_PACKAGES)) != built["installed"]:
        return False
    return not not_in_the_image(python)


def build(venv: Path) -> dict[str, str | None]:
    """A fresh venv with IMAGE_PACKAGES, as near the image's versions as pip allows here."""
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    requirements = []
    for name, image_version in IMAGE_PACKAGES.items():
        if image_version is None:
            requirements.append(name)
            continue
        version, note = chosen_version(python, name, image_version)
        requirements.append(f"{name}=={version}")
        if note:
            print(f"gpu-image-venv: {name} {version} instead of the image's {image_version}: "
                  f"{note} (Python {platform.python_version()})", flush=True)
    print(f"gpu-image-venv: pip install {' '.join(requirements)}", flush=True)
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements],
        timeout=PIP_TIMEOUT_S, check=False,
    )
    if pip.returncode != 0:
        raise SystemExit(f"gpu-image-venv: pip could not install {requirements} into {venv}")
    installed = installed_versions(python, list(IMAGE_PACKAGES))
    missing = [name for name, version in installed.items() if version is None]
    if missing:
        raise SystemExit(f"gpu-image-venv: {missing} are not in {venv} after pip install")
    dropped = drop_what_the_image_lacks(python)
    if dropped:
        print(f"gpu-image-venv: uninstalled {dropped}: pip brought them as dependencies, and "
              "the GPU machine's image has none of them", flush=True)
    stamp = {"python": platform.python_version(), "image": IMAGE_PACKAGES,
             "image_distributions": sorted(IMAGE_DISTRIBUTIONS), "installed": installed}
    (venv / STAMP_NAME).write_text(json.dumps(stamp, indent=1), encoding="utf-8")
    return installed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", type=Path, help="the virtual environment's folder")
    args = parser.parse_args(argv)
    python = args.venv / "bin" / "python"
    if reusable(args.venv, python):
        print(f"gpu-image-venv: reusing {args.venv} (versions verified)", flush=True)
        installed = installed_versions(python, list(IMAGE_PACKAGES))
    else:
        installed = build(args.venv)
    print(f"gpu-image-venv: Python {platform.python_version()} here, {IMAGE_PYTHON} on the GPU "
          "machine; package: the image's version -> this venv's", flush=True)
    for name, image_version in IMAGE_PACKAGES.items():
        print(f"  {name}: {image_version or '?'} -> {installed[name]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
