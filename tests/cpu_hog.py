"""Runs a command while every CPU core is busy: `python -P tests/cpu_hog.py -- COMMAND...`.

One busy-looping process per core this process may run on, at normal priority, is started
before the command and stopped after it, whatever its outcome (a failure, Ctrl-C, a signal);
a hog whose parent went away stops by itself, so none outlives the run. The exit status is the
command's. `make test-stress` runs the fault and end-to-end tests this way: they must hold on a
machine with no idle core.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import time

PARENT_CHECK_EVERY = 1_000_000  # loop iterations between checks that the parent still runs


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
    for hog in hogs:
        hog.start()
    return hogs


def stop_hogs(hogs: list[multiprocessing.Process]) -> None:
    for hog in hogs:
        hog.terminate()
    for hog in hogs:
        hog.join(5)
        if hog.is_alive():
            hog.kill()
            hog.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -P tests/cpu_hog.py", description=__doc__)
    parser.add_argument(
        "--processes", type=int, default=len(os.sched_getaffinity(0)),
        help="busy-looping processes (default: one per usable core)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: python -P tests/cpu_hog.py -- COMMAND [ARG...]")
    if args.processes < 1:
        parser.error(f"--processes is {args.processes}; expected at least 1")

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through the finally below

    signal.signal(signal.SIGTERM, on_term)
    hogs = start_hogs(args.processes)
    started = time.monotonic()
    print(f"cpu_hog: {len(hogs)} busy-looping processes started; running {' '.join(command)}",
          flush=True)
    try:
        process = subprocess.Popen(command)
        try:
            returncode = process.wait()
        except KeyboardInterrupt:
            process.send_signal(signal.SIGINT)
            returncode = process.wait()
    finally:
        stop_hogs(hogs)
    print(f"cpu_hog: the command exited with status {returncode} after "
          f"{time.monotonic() - started:.0f} s; the busy processes are stopped", flush=True)
    return returncode


if __name__ == "__main__":
    sys.exit(main())
