"""Every CPU core kept busy by other processes, as on a GPU host whose CPUs are shared.

    python -P -m pdserve.bench.cpu_hog [--processes N] -- COMMAND [ARG...]

runs COMMAND while one busy-looping process per core this process may run on, at normal
priority, runs beside it: started before the command and stopped after it, whatever its outcome
(a failure, Ctrl-C, a signal). The exit status is the command's. `make test-stress` runs the
fault and end-to-end tests this way: they must hold on a machine with no idle core.

In Python, `with busy_cores():` does the same around a block (bench/burst.py's loaded host).
Either way a hog whose parent went away stops by itself, so none outlives the run.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

PARENT_CHECK_EVERY = 1_000_000  # loop iterations between checks that the parent still runs
STOP_TIMEOUT_S = 5.0


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def busy_loop(parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the command; the parent stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    counter = 0
    while True:
        counter += 1
        if counter % PARENT_CHECK_EVERY == 0 and os.getppid() != parent_pid:
            return


def start_hogs(count: int) -> list[multiprocessing.Process]:
    context = multiprocessing.get_context("fork")
    hogs = [
        context.Process(target=busy_loop, args=(os.getpid(),), name=f"cpu-hog-{i}", daemon=True)
        for i in range(count)
    ]
    try:
        for hog in hogs:
            hog.start()
    except BaseException:
        stop_hogs([hog for hog in hogs if hog.pid is not None])
        raise
    return hogs


def stop_hogs(hogs: list[multiprocessing.Process]) -> None:
    for hog in hogs:
        hog.terminate()
    for hog in hogs:
        hog.join(STOP_TIMEOUT_S)
        if hog.is_alive():
            hog.kill()
            hog.join()


@contextlib.contextmanager
def busy_cores(processes: int | None = None) -> Iterator[list[multiprocessing.Process]]:
    """One busy-looping process per usable core (or `processes` of them) while the block runs,
    stopped when it exits, however it exits."""
    count = usable_cores() if processes is None else processes
    if count < 1:
        raise ValueError(f"busy_cores needs at least 1 process; got {count}")
    hogs = start_hogs(count)
    try:
        yield hogs
    finally:
        stop_hogs(hogs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -P -m pdserve.bench.cpu_hog",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--processes", type=int, default=usable_cores(),
        help="busy-looping processes (default: one per usable core)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: python -P -m pdserve.bench.cpu_hog -- COMMAND [ARG...]")
    if args.processes < 1:
        parser.error(f"--processes is {args.processes}; expected at least 1")

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through busy_cores' finally

    signal.signal(signal.SIGTERM, on_term)
    started = time.monotonic()
    with busy_cores(args.processes) as hogs:
        print(f"cpu_hog: {len(hogs)} busy-looping processes started; running {' '.join(command)}",
              flush=True)
        process = subprocess.Popen(command)
        try:
            returncode = process.wait()
        except KeyboardInterrupt:
            process.send_signal(signal.SIGINT)
            returncode = process.wait()
    print(f"cpu_hog: the command exited with status {returncode} after "
          f"{time.monotonic() - started:.0f} s; the busy processes are stopped", flush=True)
    return returncode


if __name__ == "__main__":
    sys.exit(main())
