"""The launcher's children's output: one log file per child, echoed once the deployment is ready.

Each child (router, node) writes its stdout and stderr into `<folder>/<name>.log` (a restarted
node appends to its file). During start-up nothing is echoed: a child that fails to start is
reported in one line, `failed_start_line`, with its last line and its log's path, instead of
every child's traceback, and every 10 s the launcher says each child's last line
(`starting_line`), so a slow start (a first compile of the CPU kernels) is seen, not silent.
Once the deployment is ready the launcher's supervision loop calls
`echo_new()`, which copies the lines written since to the launcher's stderr, so the terminal (or
a container's log collector) sees every child's log from then on.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import BinaryIO, TextIO

_TAIL_BYTES = 1 << 16
#: what precedes a log record's message in a child's text log: its time, level and logger
LOG_PREFIX = re.compile(r"^.*?\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


def log_message(line: str) -> str:
    """A text log line without its time, level and logger; other lines as they are."""
    return LOG_PREFIX.sub("", line, count=1).strip()


class ChildLogs:
    def __init__(self, folder: Path, echo_to: TextIO | None = None) -> None:
        self.folder = folder
        self.echo_to = echo_to or sys.stderr
        self._echoed: dict[str, int] = {}  # child name -> bytes of its log already echoed

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def open_for_child(self, name: str) -> BinaryIO:
        """The file a child's stdout and stderr go to (the caller closes its own handle after
        the child has started)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return open(self.path(name), "ab")

    def skip_written(self) -> None:
        """Start echoing from what each child writes from now on."""
        for path in self.folder.glob("*.log"):
            self._echoed[path.stem] = path.stat().st_size

    def echo_new(self) -> None:
        """Copies the complete lines each child wrote since the last call to `echo_to`."""
        for path in sorted(self.folder.glob("*.log")):
            start = self._echoed.get(path.stem, 0)
            with open(path, "rb") as log:
                log.seek(start)
                chunk = log.read()
            end = chunk.rfind(b"\n") + 1
            if end:
                self.echo_to.write(chunk[:end].decode("utf-8", errors="replace"))
                self._echoed[path.stem] = start + end
        self.echo_to.flush()

    def last_line(self, name: str) -> str:
        """The last non-blank line a child wrote (a traceback's last line is its error)."""
        try:
            with open(self.path(name), "rb") as log:
                log.seek(0, 2)
                log.seek(max(0, log.tell() - _TAIL_BYTES))
                tail = log.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        lines = [line.strip() for line in tail.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def starting_line(self, elapsed_s: float) -> str:
        """`pdserve: starting (N s): NAME: LAST LINE; ...`, every child that has written: what
        start-up is doing while nothing is echoed yet (loading, compiling, warming up)."""
        lasts = [
            f"{path.stem}: {log_message(line)}"
            for path in sorted(self.folder.glob("*.log"))
            if (line := self.last_line(path.stem))
        ]
        return f"pdserve: starting ({elapsed_s:.0f} s): " + ("; ".join(lasts) or "no output yet")

    def failed_start_line(self, name: str, status: int | None) -> str:
        """`pdserve: NAME exited with status S during start-up: LAST LINE (full log: PATH)`."""
        last = self.last_line(name) or "(no output)"
        return (
            f"pdserve: {name} exited with status {status} during start-up: {last} "
            f"(full log: {self.path(name)})"
        )
