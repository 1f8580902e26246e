"""`make gpu-dryrun`: proves on a CPU that `make gpu-check` gets past its imports on the GPU
machine, whose Python has only its image's packages and the wheels of `make gpu-wheels`, with
the checkout not installed. The Makefile runs it with the venv of bench/gpu_image_venv.py (the
image's packages) after downloading the wheels for that venv's Python into DIR/wheels:

    .gpu-dryrun/venv/bin/python -P bench/gpu_dryrun.py .gpu-dryrun

It exits 1, naming each module, package or test file at fault, unless all of these hold:

  wheels   none of the wheels' modules imports from the venv alone, and bench/gpu_check.py's
           own wheels step installs DIR/wheels offline into a fresh DIR/site, after which they
           import
  imports  in one child with the GPU check's own environment (gpu_check.checkout_env: the
           checkout only as `pdserve.<folder>` and `tests.<module>`, never the checkout root),
           every module of every package the wheel ships (pyproject's [tool.setuptools]
           packages), everything bench/gpu_checks.py imports (each name of a `from` import
           too), and the test modules of the check's pytest steps import; and no module was
           found in one of our folders under a bare name
  collect  `pytest --collect-only` of each pytest step's tests, run as the step runs pytest,
           has no error and collects at least one test from every file
  budget   the steps' limits and the report's reserve fit the check's total budget, which is
           at most MAX_BUDGET_S

Without a GPU, the test modules import and collect under TRITON_INTERPRET=1 (the GPU check runs
them compiled, with 0), and nothing is run. The children's output goes to DIR/gpu_check.log,
as the GPU check's wheels step writes it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_BUDGET_S = 420  # a whole run, with room for a second one in a quarter of an hour
CHILD_TIMEOUT_S = 300
CPU_ENV = {"TRITON_INTERPRET": "1"}
CHECKOUT_LINK_DIR = Path(tempfile.gettempdir()) / "pdserve-gpu-dryrun-checkout"
Context = Any  # bench/gpu_check.py's Context; that file is loaded by path, at run time


def load_gpu_check() -> ModuleType:
    """bench/gpu_check.py as the GPU machine runs it: a script of the checkout, not installed."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "bench/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def run_logged(argv: list[str], env: dict[str, str], log: Path, stdin: str = "") -> int:
    """Runs argv from the checkout root with its output appended to `log`; its exit status."""
    with open(log, "a", encoding="utf-8") as sink:
        sink.write(f"\n$ {' '.join(argv)}\n")
        sink.flush()
        try:
            return subprocess.run(
                argv, cwd=REPO_ROOT, env=env, input=stdin, text=True, stdout=sink,
                stderr=subprocess.STDOUT, timeout=CHILD_TIMEOUT_S, check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            sink.write(f"\n[gpu-dryrun] stopped after {CHILD_TIMEOUT_S} s\n")
            return -1


# ---------------------------------------------------------------- wheels


def check_wheels(gpu_check: ModuleType, ctx: Context, log: Path) -> list[str]:
    """The GPU check's wheels step, into a fresh site folder, from a venv that lacks them all."""
    bare_env = {**ctx.env, "PYTHONPATH": str(CHECKOUT_LINK_DIR)}
    already = [
        module for module in gpu_check.WHEEL_MODULES
        if run_logged([ctx.python, "-c", f"import {module}"], bare_env, log) == 0
    ]
    if already:
        return [(f"wheels: the venv itself has {already}, which on the GPU machine only the "
                 "wheels bring: it is not the image's package set")]
    shutil.rmtree(ctx.site_dir, ignore_errors=True)
    limit_s = next(step.limit_s for step in gpu_check.STEPS if step.name == "wheels")
    begun = time.monotonic()
    outcome = gpu_check.step_wheels(ctx, limit_s)
    print(f"[gpu-dryrun] wheels: the GPU check's wheels step: {outcome.status} in "
          f"{time.monotonic() - begun:.0f} s of its {limit_s} s; {outcome.detail}", flush=True)
    if outcome.status == "pass" and "installed" in outcome.numbers:
        return []
    missing = [
        module for module in gpu_check.WHEEL_MODULES
        if run_logged([ctx.python, "-c", f"import {module}"], ctx.env, log) != 0
    ]
    return [(f"wheels: {outcome.detail}; not importable after it: {missing or 'none'} "
             "(is each one's distribution in GPU_WHEEL_PACKAGES of the Makefile?)")]


# ---------------------------------------------------------------- imports


def package_modules() -> list[str]:
    """Every module of every package the wheel ships, as `pdserve.<folder>...` names."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    setuptools = pyproject["tool"]["setuptools"]
    root = REPO_ROOT / setuptools["package-dir"]["pdserve"]
    names = []
    for package in setuptools["packages"]:
        names.append(package)
        folder = root.joinpath(*package.split(".")[1:])
        names += [f"{package}.{path.stem}" for path in sorted(folder.glob("*.py"))
                  if path.stem not in ("__init__", "__main__")]
    return names


def imports_of(path: Path) -> dict[str, list[str]]:
    """Module -> the names a `from` import takes from it, of every import statement in the
    file, those inside functions included."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, [])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.setdefault(node.module, []).extend(alias.name for alias in node.names)
    found.pop("__future__", None)
    return found


def module_of_target(target: str) -> str:
    """tests/engine/test_x.py::test_y -> tests.engine.test_x"""
    return target.split("::")[0].removesuffix(".py").replace("/", ".")


def num_collected(target: str, test_ids: list[str]) -> int:
    """How many of the collected ids a pytest target (a file, or file::test) stands for."""
    file, _, test = target.partition("::")
    prefix = target if test else f"{file}::"
    return sum(test_id.startswith(prefix) for test_id in test_ids)


def has_name(module: ModuleType, name: str) -> bool:
    """`from module import name` would work: an attribute, or a submodule of a package."""
    if hasattr(module, name):
        return True
    try:
        importlib.import_module(f"{module.__name__}.{name}")
    except ModuleNotFoundError:
        return False
    return True


def import_each(wanted: dict[str, list[str]], result_path: Path) -> int:
    """In the child: imports each module and looks up the names taken from it; writes
    {module: error or null} and the modules found in our folders under a bare name."""
    errors: dict[str, str | None] = {}
    for module_name, names in wanted.items():
        try:
            module = importlib.import_module(module_name)
            absent = [name for name in names if not has_name(module, name)]
            errors[module_name] = f"it has no {absent}, imported from it" if absent else None
        except BaseException as error:  # noqa: BLE001 (each failure is reported by name)
            errors[module_name] = f"{type(error).__name__}: {error}"[:500]
    ours = {path.name for path in REPO_ROOT.iterdir() if (path / "__init__.py").exists()}
    shadowing = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or name.split(".")[0] in ("pdserve", "tests", "__main__", "__mp_main__"):
            continue
        resolved = Path(file).resolve()
        if resolved.is_relative_to(REPO_ROOT) and resolved.relative_to(REPO_ROOT).parts[0] in ours:
            shadowing.append(f"{name} ({resolved.relative_to(REPO_ROOT)})")
    result = {"errors": errors, "shadowing": sorted(shadowing)}
    result_path.write_text(json.dumps(result), encoding="utf-8")
    return 0


def check_imports(gpu_check: ModuleType, ctx: Context, log: Path) -> list[str]:
    wanted = {name: [] for name in package_modules()}
    for module, names in imports_of(REPO_ROOT / "bench/gpu_checks.py").items():
        if module.split(".")[0] not in sys.stdlib_module_names:
            wanted.setdefault(module, []).extend(names)
    for step in pytest_steps(gpu_check):
        for target in step.targets:
            wanted.setdefault(module_of_target(target), [])
    result_path = ctx.scratch / "imports.json"
    argv = [ctx.python, "-m", "pdserve.bench.gpu_dryrun", "--import-each", str(result_path)]
    begun = time.monotonic()
    code = run_logged(argv, {**ctx.env, **CPU_ENV}, log, stdin=json.dumps(wanted))
    if code != 0 or not result_path.exists():
        return [f"imports: the importing child ({' '.join(argv[1:4])}) exited {code}; see {log}"]
    result = json.loads(result_path.read_text(encoding="utf-8"))
    imported = sorted(name for name, error in result["errors"].items() if error is None)
    print(f"[gpu-dryrun] imports: {len(imported)} of {len(wanted)} modules in "
          f"{time.monotonic() - begun:.0f} s: {', '.join(imported)}", flush=True)
    problems = [f"imports: {name}: {error}" for name, error in result["errors"].items() if error]
    if result["shadowing"]:
        problems.append(f"imports: modules found in our folders under a bare name (the checkout "
                        f"root was on sys.path): {', '.join(result['shadowing'])}")
    return problems


# ---------------------------------------------------------------- collect


def pytest_steps(gpu_check: ModuleType) -> list[Any]:
    return [step.run for step in gpu_check.STEPS if isinstance(step.run, gpu_check.PytestStep)]


def check_collect(gpu_check: ModuleType, ctx: Context, log: Path) -> list[str]:
    problems = []
    for step in pytest_steps(gpu_check):
        argv = [ctx.python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                *step.targets]
        begun = time.monotonic()
        listed = subprocess.run(
            argv, cwd=REPO_ROOT, env={**ctx.env, **CPU_ENV}, capture_output=True, text=True,
            timeout=CHILD_TIMEOUT_S, check=False,
        )
        with open(log, "a", encoding="utf-8") as sink:
            sink.write(f"\n$ {' '.join(argv)}\n{listed.stdout}{listed.stderr}")
        files = tuple(f"{target.split('::')[0]}::" for target in step.targets)
        ids = [line for line in listed.stdout.splitlines() if line.startswith(files)]
        counts = {target: num_collected(target, ids) for target in step.targets}
        print(f"[gpu-dryrun] collect {step.name}: {len(ids)} tests in "
              f"{time.monotonic() - begun:.0f} s (exit {listed.returncode})", flush=True)
        for target, count in counts.items():
            print(f"    {count:4d}  {target}", flush=True)
        if listed.returncode != 0:
            errors = [line for line in listed.stdout.splitlines() if line.startswith("ERROR")]
            problems.append(f"collect {step.name}: pytest exited {listed.returncode}: "
                            f"{'; '.join(errors) or listed.stdout.strip()[-300:]}; see {log}")
        problems += [f"collect {step.name}: {target} collected no test"
                     for target, count in counts.items() if count == 0]
    return problems


# ---------------------------------------------------------------- budget


def check_budget(gpu_check: ModuleType) -> list[str]:
    limits = {step.name: step.limit_s for step in gpu_check.STEPS}
    needed = sum(limits.values()) + gpu_check.REPORT_RESERVE_S
    budget = gpu_check.TOTAL_BUDGET_S
    print(f"[gpu-dryrun] budget: steps {limits} + report {gpu_check.REPORT_RESERVE_S} s = "
          f"{needed} s of the check's {budget} s (at most {MAX_BUDGET_S} s)", flush=True)
    problems = []
    if needed > budget:
        problems.append(f"budget: the steps' limits and the report's reserve add up to "
                        f"{needed} s, over the check's TOTAL_BUDGET_S of {budget} s")
    if budget > MAX_BUDGET_S:
        problems.append(f"budget: TOTAL_BUDGET_S is {budget} s; at most {MAX_BUDGET_S} s fits "
                        "a run and a rerun")
    return problems


# ---------------------------------------------------------------- the driver


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, nargs="?", help="holds wheels/; gets site/ and the log")
    parser.add_argument("--import-each", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.import_each is not None:  # the importing child
        return import_each(json.loads(sys.stdin.read()), args.import_each)
    if args.dir is None:
        parser.error("the dry run's folder (with wheels/ in it) is needed")
    started = time.monotonic()
    gpu_check = load_gpu_check()
    work = args.dir.resolve()
    log = work / "gpu_check.log"  # where the wheels step (gpu_check.run_child) writes too
    log.write_text("", encoding="utf-8")
    env = gpu_check.checkout_env(dict(os.environ), work / "site", CHECKOUT_LINK_DIR)
    print(f"[gpu-dryrun] Python {sys.version.split()[0]} ({sys.executable}); checkout as "
          f"pdserve through {CHECKOUT_LINK_DIR}; PYTHONPATH={env['PYTHONPATH']}", flush=True)
    problems = check_budget(gpu_check)
    with tempfile.TemporaryDirectory(prefix="gpu-dryrun-") as scratch:
        ctx = gpu_check.Context(work, Path(scratch), env, python=sys.executable,
                                wheels_dir=work / "wheels", site_dir=work / "site")
        wheel_problems = check_wheels(gpu_check, ctx, log)
        problems += wheel_problems
        if not wheel_problems:  # without them, every module that needs one would fail too
            problems += check_imports(gpu_check, ctx, log)
            problems += check_collect(gpu_check, ctx, log)
    seconds = time.monotonic() - started
    if problems:
        print(f"\ngpu-dryrun: FAILED in {seconds:.0f} s ({len(problems)} problems; the children's "
              f"output is in {log}):", flush=True)
        for problem in problems:
            print(f"  - {problem}", flush=True)
        return 1
    print(f"\ngpu-dryrun: passed in {seconds:.0f} s: `make gpu-check` imports and collects "
          "everything it needs with the GPU machine's packages and the wheels", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
