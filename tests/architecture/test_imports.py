"""The import rules of docs/design.md ("Architecture"), checked on every module's source.

Imports point one way: kernels <- engine <- kvtransfer <- node (with the colocated node) <-
prefill_node / decode_node, and commands/ launches them (`python -m pdserve.node ROLE`, which
finds a role's node class by the name wire/roles.py gives it, not by an import). Every folder is installed as
`pdserve.<folder>` and imported by that name only: nothing imports a bare `engine` or `router`.
The wire layer (wire/) and the text layer
(text/) import no torch and no model code, and the router imports only them, so the router
process never loads torch (test_router_process_never_loads_torch starts one to see). No
serving code imports bench/, tests/ or testing/ (only `pdserve bench serve` dispatches to
bench/; testing/ holds the tiny random models the tests and bench's GPU check build, and
nothing imports tests/). Every import counts, including those inside functions.

Inside engine/, each sub-package is a room with its own rule (ENGINE_ROOMS): the KV cache (kv/)
sees nothing of scheduling (sched/), sampling (sample/) or the model runner (runner/), and what
the CPU offers (cpu/) sees no other room. The modules on top of engine/ (config, sequence, the
engine itself) are not a room: every room may import them.

Inside router/, the same way (ROUTER_ROOMS): the cluster client (cluster/) imports nothing of the
OpenAI HTTP surface (api/), which may import the cluster client, nor any web framework (WEB): it
raises router/errors.py's `APIError`, which api/ answers over HTTP. The modules on top of router/
(config, errors, state, generation, metrics, choice_groups, __main__) may be imported by both.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = sorted(
    path.parent.name for path in ROOT.glob("*/__init__.py") if path.parent.name != "tests"
)
HEAVY = ("torch", "transformers", "triton", "safetensors", "gguf", "numpy")
# What each package may import of the project (itself always); None: anything.
ALLOWED: dict[str, set[str] | None] = {
    "wire": set(),
    "text": set(),
    "kernels": set(),
    "model_store": set(),
    "engine": {"kernels", "wire", "text", "model_store"},
    "kvtransfer": {"engine", "wire"},
    "node": {"engine", "kvtransfer", "wire", "text"},
    "prefill_node": {"node", "engine", "kvtransfer", "wire"},
    "decode_node": {"node", "engine", "kvtransfer", "wire"},
    "router": {"wire", "text"},
    "planner": {"bench", "engine", "router", "wire"},
    "commands": set(PROJECT),
    "bench": None,
    "testing": set(),
}
# What each room of engine/ may import of the other rooms (itself and engine's top-level
# modules always); None: anything.
ENGINE = ROOT / "engine"
ENGINE_ROOMS: dict[str, set[str] | None] = {
    "cpu": set(),
    "kv": {"cpu", "prefix_cache"},
    "prefix_cache": {"kv"},
    "sched": {"kv"},
    "sample": {"sched"},
    "attention": {"kv"},
    "layers": {"cpu", "distributed"},
    "models": {"attention", "cpu", "distributed", "layers"},
    "runner": {"attention", "cpu", "distributed", "kv", "layers", "models", "sample", "sched"},
    "distributed": {"cpu", "kv", "runner"},
}
# What each room of router/ may import of the other rooms (itself and router's top-level
# modules always).
ROUTER = ROOT / "router"
ROUTER_ROOMS: dict[str, set[str] | None] = {
    "cluster": set(),
    "api": {"cluster"},
}
# The HTTP stack, which the router's cluster client (router/cluster/) never imports.
WEB = ("fastapi", "starlette", "uvicorn", "httptools", "h11", "pydantic")
# Packages whose processes must stay light: no torch, no model code.
TORCH_FREE = ("wire", "text", "router")


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every absolute import in the file; `from a.b import c` gives
    `a.b.c`, which may be a module (`from pdserve import engine`, `from pdserve.router import
    api`) or a name in `a.b`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, room) of every absolute import: the project folder for `pdserve.<folder>...`, the
    top-level module for anything else."""
    found = []
    for line, name in imported_names(path):
        parts = name.split(".")
        found.append((line, parts[1] if parts[0] == "pdserve" and len(parts) > 1 else parts[0]))
    return found


def modules_of(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_every_package_has_a_rule():
    assert set(PROJECT) == set(ALLOWED), set(PROJECT) ^ set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_layer_may(package):
    allowed = ALLOWED[package]
    broken = []
    for path in modules_of(package):
        for line, name in imports_of(path):
            own = name in PROJECT or name == "tests"
            forbidden = allowed is not None and own and name not in allowed | {package}
            if forbidden or (package in TORCH_FREE and name in HEAVY):
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not broken, "\n".join(broken)


def test_the_project_is_imported_by_its_installed_names_only():
    """The wheel installs the folders under `pdserve.`; a bare `import engine` works only from a
    checkout and would break the installed package."""
    broken = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        if ".venv" in path.parts or path.parts[len(ROOT.parts)].startswith("."):
            continue
        for line, name in imported_names(path):
            if name.split(".")[0] in PROJECT:
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not broken, "\n".join(broken)


def rooms_imported(path: Path, package: Path) -> list[tuple[int, str]]:
    """(line, room) of every import of a room of `package`: `pdserve.<package>.<room>...`
    where <room> is a sub-package."""
    found = []
    for line, name in imported_names(path):
        parts = name.split(".")
        if (
            parts[:2] == ["pdserve", package.name]
            and len(parts) > 2
            and (package / parts[2]).is_dir()
        ):
            found.append((line, parts[2]))
    return found


# The packages divided into rooms: their folder and each room's rule.
ROOMS = {"engine": (ENGINE, ENGINE_ROOMS), "router": (ROUTER, ROUTER_ROOMS)}


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_every_room_has_a_rule(package):
    folder, rules = ROOMS[package]
    rooms = {path.parent.name for path in folder.glob("*/__init__.py")}
    assert rooms == set(rules), rooms ^ set(rules)


@pytest.mark.parametrize(
    ("package", "room"), [(package, room) for package in ROOMS for room in sorted(ROOMS[package][1])]
)
def test_room_imports_only_what_its_rule_allows(package, room):
    folder, rules = ROOMS[package]
    allowed = rules[room]
    broken = []
    for path in sorted((folder / room).rglob("*.py")):
        for line, name in rooms_imported(path, folder):
            if allowed is not None and name not in allowed | {room}:
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {package}/{name}")
    assert not broken, "\n".join(broken)


def test_the_cluster_client_imports_no_web_framework():
    broken = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROUTER / "cluster").rglob("*.py"))
        for line, name in imports_of(path)
        if name in WEB
    ]
    assert not broken, "\n".join(broken)


def test_commands_import_no_node_code_at_module_level():
    broken = []
    for path in modules_of("commands"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            names = [n.split(".")[1] if n.startswith("pdserve.") else n.split(".")[0]
                     for n in names]
            heavy = [n for n in names if n in HEAVY or n in ("engine", "kernels", "kvtransfer")]
            broken += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in heavy]
    assert not broken, "\n".join(broken)


def test_the_rules_catch_a_forbidden_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    import torch\n    from pdserve.engine.llm import LLM\n"
        "from pdserve import kvtransfer\n"
    )
    assert sorted(imports_of(module)) == [(2, "torch"), (3, "engine"), (4, "kvtransfer")]


@pytest.mark.parametrize(
    ("package", "top_module", "room_module", "room", "forbidden_in"),
    [
        ("engine", "sequence", "sched.scheduler", "sched", "kv"),
        ("router", "errors", "api.schemas", "api", "cluster"),
    ],
)
def test_the_room_rules_catch_a_forbidden_import(
    tmp_path, package, top_module, room_module, room, forbidden_in
):
    folder, rules = ROOMS[package]
    module = tmp_path / "m.py"
    module.write_text(
        f"from pdserve.{package}.{top_module} import X\n"
        f"def f():\n    from pdserve.{package}.{room_module} import Y\n"
        f"from pdserve.{package} import {room}\n"
    )
    assert sorted(rooms_imported(module, folder)) == [(3, room), (4, room)]
    assert room not in rules[forbidden_in]


@pytest.mark.processes
def test_router_process_never_loads_torch(tiny_llama_dir):
    """A router process that builds its app (tokenizer, node links, routes) and answers a chat
    request's tokenization holds no torch, transformers or project model code."""
    script = f"""
import sys
from pathlib import Path
from pdserve.router.api.app import create_app
from pdserve.router.config import RouterConfig
import pdserve.router.__main__
app = create_app(RouterConfig(model_path=Path({str(tiny_llama_dir)!r}), node_addresses=[]))
tokenizer = app.state.router.tokenizer
assert tokenizer.encode("hello world")
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "triton")
      or m.split(".")[:2] in [["pdserve", n] for n in ("engine", "kernels", "kvtransfer", "node")]))
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
