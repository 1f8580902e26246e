"""Our top-level folders are `pdserve.<folder>` everywhere, never a bare top-level module.

A package installed under the bare name of one of our folders (Hugging Face's `kernels`, which
transformers imports; any release could add an `engine` or a `router`) must stay importable in
every process pdserve starts and in the test process, even when that process starts in the
checkout. Here a decoy package of every folder's name is installed (a folder on PYTHONPATH, as
site-packages would hold it); each role's process is started from the repository root with the
interpreter, flags and environment the launcher plans for it, running a probe in place of the
role's module. The probe must find the decoy for every bare name and our folder for
`pdserve.<folder>`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.commands.cli import build_parser
from pdserve.commands.launcher import plan_nodes
from pdserve.commands.model_source import ServedModel
from pdserve.commands.router_plan import plan_router
from pdserve.wire.roles import Role

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = sorted(path.parent.name for path in ROOT.glob("*/__init__.py"))
PACKAGES = [name for name in FOLDERS if name != "tests"]  # tests/ is not part of pdserve
PROBE = "pdserve_decoy_probe"
PROBE_SOURCE = '''
import importlib, json, sys

def origin(name):
    try:
        return importlib.import_module(name).__file__
    except ImportError as error:
        return f"ImportError: {error}"

names = json.loads(sys.argv[1])
print(json.dumps({
    "bare": {name: origin(name) for name in names},
    "pdserve": {name: origin("pdserve." + name) for name in names if name != "tests"},
}))
'''


@pytest.fixture(scope="module")
def decoys(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("decoy-site")
    for name in FOLDERS:
        (site / name).mkdir()
        (site / name / "__init__.py").write_text("DECOY = True\n")
    (site / f"{PROBE}.py").write_text(PROBE_SOURCE)
    return site


def launcher_plans() -> dict[str, tuple[list[str], dict[str, str]]]:
    """argv and environment of every role's process, as `pdserve serve` plans them."""
    plans = {}
    for flags in ([], ["--colocated"]):
        args = build_parser().parse_args(["serve", "--model", "/models/tiny", *flags])
        for node in plan_nodes(args, "/models/tiny", "tcp://127.0.0.1:26990"):
            plans[node.argv[-1]] = (node.argv[:-1], node.env)  # the role is the module's argument
    router = plan_router(
        args, ServedModel(Path("/models/tiny"), ("tiny",)), "tcp://127.0.0.1:26992",
        ["node-0=tcp://127.0.0.1:26991"], "s" * 32,
    )
    plans[router.argv[-1]] = (router.argv, router.env)
    return plans


def test_the_launcher_plans_every_role():
    assert set(launcher_plans()) == {"pdserve.router", *Role}


@pytest.mark.parametrize("role", sorted(launcher_plans()))
def test_each_role_finds_installed_packages_by_bare_name_and_ours_as_pdserve(role, decoys):
    argv, env = launcher_plans()[role]
    # What the launcher starts, from the repository root, with the role's module swapped for
    # the probe (which lies beside the decoys, so only that one name changes).
    environment = {**os.environ, **env, "PYTHONPATH": str(decoys)}
    environment.pop("PYTHONSAFEPATH", None)  # the test session's own guard must not help
    probe = subprocess.run(
        [*argv[:-1], PROBE, json.dumps(FOLDERS)], cwd=ROOT, env=environment,
        capture_output=True, text=True, timeout=300, check=True,
    )
    found = json.loads(probe.stdout.splitlines()[-1])
    for name in FOLDERS:
        assert found["bare"][name] == str(decoys / name / "__init__.py"), (role, name)
    for name in PACKAGES:
        assert found["pdserve"][name] == str(ROOT / name / "__init__.py"), (role, name)


def test_the_test_process_never_has_the_checkout_root_on_its_path():
    """pytest itself loads tests/ as the package `tests`, by file location (importlib mode);
    every other folder's bare name is left to whatever is installed."""
    assert all(Path(entry or ".").resolve() != ROOT for entry in sys.path)
    for name in PACKAGES:
        module = sys.modules.get(name)
        spec = importlib.util.find_spec(name) if module is None else module.__spec__
        origin = spec.origin if spec is not None and spec.origin else ""
        assert not origin.startswith(str(ROOT / name)), (name, origin)


def test_children_of_the_test_process_start_in_safe_path_mode():
    answer = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.flags.safe_path)"], cwd=ROOT,
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert answer.stdout.strip() == "True"
