"""The wheel ships every package of the checkout: pyproject.toml lists its packages by hand
(the checkout root is the package), so a new folder must be added there, or the installed
product lacks it while the editable checkout still imports it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_SHIPPED = ("tests", ".")  # tests stay in the checkout; hidden folders are build outputs


def test_every_package_folder_is_in_the_wheel():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    found = {
        "pdserve." + ".".join(init.parent.relative_to(ROOT).parts)
        for init in ROOT.rglob("__init__.py")
        if init.parent != ROOT
        and not init.relative_to(ROOT).parts[0].startswith(NOT_SHIPPED)
        and "site-packages" not in init.parts
    }
    assert found == listed, {"missing": sorted(found - listed), "stale": sorted(listed - found)}
