"""docs/design.md's module map names every module of the packages, and nothing else.

The map is the "## Module map" section: one list item per module, the path first, in
backticks, then a colon and a one-line description (- `router/cluster/queue_delay.py`: how long ...).
Package `__init__.py` files are left out of it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN_DOC = ROOT / "docs" / "design.md"
# Every top-level package of the project; tests/ documents itself.
PACKAGES = tuple(
    sorted(
        path.parent.name
        for path in ROOT.glob("*/__init__.py")
        if path.parent.name != "tests"
    )
)
MAP_HEADING = "## Module map"
MAP_ENTRY = re.compile(r"^- `(?P<path>[^`]+)`:(?P<description>.*)$", re.MULTILINE)


def package_modules() -> set[str]:
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py"
    }


def module_map_section() -> str:
    text = DESIGN_DOC.read_text(encoding="utf-8")
    start = text.find(f"\n{MAP_HEADING}\n")
    assert start != -1, f"{DESIGN_DOC.relative_to(ROOT)} has no {MAP_HEADING!r} section"
    following = re.search(r"^## ", text[start + len(MAP_HEADING) + 2 :], re.MULTILINE)
    end = start + len(MAP_HEADING) + 2 + following.start() if following else len(text)
    return text[start:end]


def module_map() -> dict[str, str]:
    """Path -> description of every entry, failing on an entry named twice."""
    entries: dict[str, str] = {}
    for match in MAP_ENTRY.finditer(module_map_section()):
        path = match["path"]
        assert path not in entries, f"the module map names {path} twice"
        entries[path] = match["description"].strip()
    return entries


def test_package_modules_are_found():
    modules = package_modules()
    assert "router/cluster/queue_delay.py" in modules
    assert "wire/messages.py" in modules
    assert not any(path.endswith("__init__.py") for path in modules)


def test_module_map_names_every_module_and_only_existing_ones():
    modules = package_modules()
    mapped = set(module_map())
    missing = sorted(modules - mapped)
    stale = sorted(mapped - modules)
    assert not missing and not stale, (
        f"docs/design.md's module map is out of date: {len(missing)} module(s) missing "
        f"from it: {missing}; {len(stale)} entry(ies) naming no module under "
        f"{', '.join(PACKAGES)}: {stale}"
    )


def test_every_module_map_entry_has_a_description():
    undescribed = sorted(path for path, description in module_map().items() if not description)
    assert not undescribed, f"module map entries without a description: {undescribed}"
