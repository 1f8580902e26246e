"""The wheel, installed into a fresh virtual environment, runs every command from outside the
checkout: every package the commands import is in the wheel, and every third-party module they
import comes from a distribution the wheel's metadata requires.

A real `pip install WHEEL` resolves torch afresh: measured on this project's CI machine, a minute
and 5.7 GiB (CUDA torch and its libraries) per run, and a torch other than the one the project
venv was tested with. Instead the fresh venv gets the wheel with `--no-deps`, and a folder on
its path that holds links to exactly the distributions the wheel's `Requires-Dist` names,
transitively, taken from the project venv (which must satisfy each version range). A module
imported from anything undeclared is then missing there, as it would be for a user.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
# Imported only by the bench scripts that draw plots, and declared in the `bench` extra.
FEATURE_EXTRAS = ("ray", "mooncake")
BENCH_EXTRA = "bench"  # what only the benchmarks import (plotting, their clients)
# `make gpu-check` runs from the checkout, whose tests/ it imports its tiny model from.
CHECKOUT_ONLY = {("tests", "pdserve/bench/gpu_checks.py")}
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
    ".ruff_cache", ".gpu-wheels", ".gpu-dryrun", ".device", ".gl", ".whl",
)


def build_wheel(out: Path) -> Path:
    """Builds from a copy of the sources, so that the checkout gets no build/ folder."""
    source = out / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (wheel,) = out.glob("pdserve-*.whl")
    return wheel


def required_distributions(root: str) -> dict[str, metadata.Distribution]:
    """`root`'s Requires-Dist (with the extras each requirement asks for), transitively, as the
    distributions installed beside this interpreter; fails naming any missing or out of range."""
    found: dict[str, metadata.Distribution] = {}
    visited: set[tuple[str, frozenset[str]]] = set()
    pending = [(Requirement(r), root) for r in metadata.requires(root) or []]
    while pending:
        requirement, wanted_by = pending.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{wanted_by} requires {requirement}, which is not installed here")
        assert requirement.specifier.contains(dist.version, prereleases=True), (
            f"{wanted_by} requires {requirement}; installed here: {dist.version}"
        )
        if (name, frozenset(requirement.extras)) in visited:
            continue
        visited.add((name, frozenset(requirement.extras)))
        found[name] = dist
        for line in dist.requires or []:
            sub = Requirement(line)
            wanted = [{"extra": ""}] + [{"extra": e} for e in requirement.extras]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in wanted):
                sub.marker = None
                pending.append((sub, name))
    return found


def link_distributions(dists: dict[str, metadata.Distribution], folder: Path) -> None:
    """Links each distribution's top-level modules, packages and metadata folder into `folder`."""
    folder.mkdir()
    for name, dist in dists.items():
        assert dist.files is not None, f"{name} {dist.version} has no RECORD to list its files"
        site = Path(dist.locate_file(""))
        tops = {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            target = folder / top
            if not target.exists() and (site / top).exists():
                target.symlink_to(site / top)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding the wheel and, on its path, exactly the declared dependencies."""
    work = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(work)
    venv = work / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    deps = work / "deps"
    link_distributions(required_distributions("pdserve"), deps)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    (Path(purelib) / "pdserve-dependencies.pth").write_text(f"{deps}\n")
    return venv


def run_installed(venv: Path, args: list[str], cwd: Path, timeout: float = 300):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PDSERVE_HOME"] = str(cwd / "pdserve-home")  # never the user's model cache
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_wheel_installs_one_top_level_name_holding_every_package(installed):
    """Only `pdserve` (no generic `engine` or `kernels` beside other projects' modules), and
    under it every package folder of the checkout, tests excepted."""
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(installed)}))
    record = next(purelib.glob("pdserve-*.dist-info")) / "RECORD"
    tops = {line.split("/")[0] for line in record.read_text().splitlines()}
    assert {t for t in tops if not t.startswith(("pdserve-", ".."))} == {"pdserve"}, tops
    assert not (purelib / "pdserve" / "tests").exists()
    folders = {p.parent.relative_to(REPO) for p in REPO.glob("*/**/__init__.py")}
    folders = {f for f in folders if f.parts[0] != "tests" and not f.parts[0].startswith(".")}
    installed_packages = {p.parent.relative_to(purelib / "pdserve")
                          for p in (purelib / "pdserve").rglob("__init__.py")}
    assert installed_packages == folders, installed_packages ^ folders


def third_party_imports(purelib: Path, ours: set[str]) -> dict[str, set[str]]:
    """Top-level module -> the installed files that import it, for every module that is
    neither ours nor the standard library's."""
    importers: dict[str, set[str]] = {}
    for package in ours:
        for path in (purelib / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    where = path.relative_to(purelib).as_posix()
                    if top in ours or top in sys.stdlib_module_names:
                        continue
                    if (top, where) not in CHECKOUT_ONLY:
                        importers.setdefault(top, set()).add(where)
    return importers


def test_every_third_party_import_is_a_declared_dependency(installed):
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(installed)}))
    (info,) = purelib.glob("pdserve-*.dist-info")
    requirements = [Requirement(r) for r in metadata.Distribution.at(info).requires or []]
    in_extra = [r for r in requirements if r.marker is not None and "extra" in str(r.marker)]
    declared = {canonicalize_name(r.name) for r in requirements if r not in in_extra}
    bench_only = {
        canonicalize_name(r.name) for r in in_extra if r.marker.evaluate({"extra": BENCH_EXTRA})
    }
    # A feature's extra (`ray`, `mooncake`): its modules import it where the feature runs, and
    # the option that turns the feature on says which extra to install when it is missing.
    feature_extras = {
        canonicalize_name(r.name) for r in in_extra
        if any(r.marker.evaluate({"extra": extra}) for extra in FEATURE_EXTRAS)
    }
    ours = {"pdserve"}
    providers = metadata.packages_distributions()
    undeclared = []
    for module, files in sorted(third_party_imports(purelib, ours).items()):
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        benches_alone = all(f.startswith("pdserve/bench/") for f in files)
        if dists & declared or (benches_alone and dists & bench_only) or dists & feature_extras:
            continue
        undeclared.append(f"{module} ({dists or 'not installed'}) in {sorted(files)[:3]}")
    assert not undeclared, (
        "imported, not in [project] dependencies (nor, by benchmarks alone, in the "
        f"{BENCH_EXTRA!r} extra, nor in a feature's extra {FEATURE_EXTRAS}): " + "; ".join(undeclared)
    )


def test_installed_commands_run_outside_the_checkout(installed, tiny_llama_dir, tmp_path):
    where = run_installed(
        installed,
        ["python", "-c",
         "import pdserve.engine as e, pdserve.router, pdserve.bench\nprint(e.__file__)"],
        tmp_path,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout
    generic = run_installed(installed, ["python", "-c", "import engine"], tmp_path)
    assert "No module named 'engine'" in generic.stderr, generic.stderr
    commands = [
        ["pdserve", "--help"],
        ["pdserve", "serve", "--help"],
        ["pdserve", "plan", "--model", "llama-3-8b"],
        ["pdserve", "bench", "serve", "--help"],
        ["pdserve", "prefill", "--help"],
        ["python", "-m", "pdserve.router", "--help"],
        ["pdserve", "generate", "--model", str(tiny_llama_dir), "--max-tokens", "2", "Hello"],
    ]
    for command in commands:
        result = run_installed(installed, command, tmp_path)
        assert result.returncode == 0, f"{' '.join(command)}:\n{result.stderr[-3000:]}"
    version = run_installed(installed, ["pdserve", "--version"], tmp_path)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert version.stdout == f"pdserve {project['version']}\n", version  # the wheel's metadata
