"""`pdserve --version`, and a top-level help that names only commands a user can type."""

from __future__ import annotations

import re

import pytest

from pdserve.commands.cli import main
from pdserve.wire.package_version import package_version


def test_version_prints_the_packages_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out == f"pdserve {package_version()}\n"
    assert re.fullmatch(r"pdserve \d+\.\d+\.\d+\S*\n", out)


def test_the_top_level_help_names_no_bare_module(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    modules = re.findall(r"python -m (\S+)", text)
    assert [module for module in modules if not module.startswith("pdserve.")] == []
    assert "colocated_node" not in text
    assert "--version" in text
