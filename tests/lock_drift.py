"""How the environment this runs in differs from the committed lock, package by package.

`make test-newest` prints this for the environment it resolves to the newest versions pip
offers, before that environment's tests, so a failure there comes with the releases that
changed named:

    python -P tests/lock_drift.py [LOCK]     # LOCK: requirements.lock by default

One line per package whose installed version differs from its locked one, is installed but not
locked, or is locked but not installed. Always exits 0: it reports, the tests judge.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(lock: Path) -> dict[str, str]:
    versions = {}
    for line in lock.read_text().splitlines():
        requirement = line.split("#", 1)[0].split(";", 1)[0].strip()
        if "==" in requirement:
            name, version = requirement.split("==", 1)
            versions[canonical(name)] = version.strip()
    return versions


def installed_versions() -> dict[str, str]:
    found = {}
    for distribution in metadata.distributions():
        name = distribution.metadata["Name"]
        if name and canonical(name) not in ("pdserve", "pip", "setuptools", "wheel"):
            found[canonical(name)] = distribution.version
    return found


def main() -> int:
    lock = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "requirements.lock"
    locked, installed = locked_versions(lock), installed_versions()
    public = {name: version.split("+", 1)[0] for name, version in installed.items()}
    changed = [
        f"  {name}: {locked.get(name, '(not locked)')} -> {installed.get(name, '(not installed)')}"
        for name in sorted(set(locked) | set(public))
        if locked.get(name) != public.get(name)
    ]
    print(f"{sys.executable}: Python {sys.version.split()[0]}; {len(installed)} packages, "
          f"{len(changed)} differ from {lock.name}")
    print("\n".join(changed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
