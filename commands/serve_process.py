"""`pdserve serve` as a child process, for tests and benchmarks: constructed ready, closed
with SIGINT (SIGKILL after 30 s)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from pdserve.commands.launcher import wait_healthy
from pdserve.wire.child_command import python_module_command
from pdserve.wire.free_ports import free_port


class ServeProcess:
    """`log_path`: where every process writes its output (default: this process's own);
    `port`: the HTTP port (default: a free one)."""

    def __init__(
        self,
        flags: list[str],
        ready_timeout_s: float = 300.0,
        quiet: bool = False,
        log_path: Path | None = None,
        port: int | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w") if log_path is not None else None  # noqa: SIM115
        output = self._log or (subprocess.DEVNULL if quiet else None)
        self.process = subprocess.Popen(
            [*python_module_command("pdserve.commands.cli"), "serve", "--port", str(self.port), *flags],
            stdout=output,
            stderr=output,
        )
        try:
            wait_healthy(self.url, lambda: self.process.poll() is not None, ready_timeout_s)
        except RuntimeError:
            self.close()
            raise

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
