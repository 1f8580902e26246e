"""bench/cpu_hog.py: one busy process per requested core while a block or a command runs, and
none left behind however it ends."""

from __future__ import annotations

import sys

import pytest

from pdserve.bench.cpu_hog import busy_cores, main, usable_cores


def test_busy_cores_runs_one_process_per_usable_core_by_default_and_stops_them():
    with busy_cores() as hogs:
        assert len(hogs) == usable_cores()
        assert all(hog.is_alive() for hog in hogs)
    assert not any(hog.is_alive() for hog in hogs)


def test_busy_cores_stops_its_processes_when_the_block_raises():
    with pytest.raises(RuntimeError, match="burst failed"), busy_cores(2) as hogs:
        assert all(hog.is_alive() for hog in hogs)
        raise RuntimeError("burst failed")
    assert not any(hog.is_alive() for hog in hogs)


def test_busy_cores_refuses_zero_processes():
    with pytest.raises(ValueError, match="got 0"), busy_cores(0):
        pass


def test_the_command_runs_beside_the_busy_processes_and_its_exit_status_is_returned(capsys):
    assert main(["--processes", "1", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    out = capsys.readouterr().out
    assert "1 busy-looping processes started" in out
    assert "exited with status 3" in out


def test_no_command_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--processes", "1"])
    assert "no command given" in capsys.readouterr().err
