"""pdserve's version: the installed package's metadata, else (a source checkout run without
installing it) the `version` in the repository's pyproject.toml, else "unknown".

`pdserve --version` prints it and the router answers it at `GET /version`. Read on each call:
nothing is cached at module level.
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "pdserve"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def package_version(pyproject: Path = PYPROJECT) -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return pyproject_version(pyproject)


def pyproject_version(pyproject: Path = PYPROJECT) -> str:
    """`[project] version` of `pyproject`, or "unknown" where it cannot be read."""
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return "unknown"
    version = project.get("version") if isinstance(project, dict) else None
    return version if isinstance(version, str) and version else "unknown"
