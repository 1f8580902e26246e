"""`pdserve serve` as a child process, for tests and benchmarks: constructed ready, closed
with SIGINT (SIGKILL after 30 s). Given `--ssl-certfile` among its flags it serves HTTPS: its
`url` says https and `tls_context` trusts that certificate (commands/router_tls.py)."""

from __future__ import annotations

import argparse
import os
import signal
import ssl
import subprocess
from pathlib import Path

from pdserve.commands.launcher import wait_healthy
from pdserve.commands.router_tls import trusting_certificate
from pdserve.wire.child_command import python_module_command
from pdserve.wire.free_ports import free_port


class ServeProcess:
    """`log_path`: where every process writes its output (default: this process's own);
    `port`: the HTTP port (default: a free one); `environment`: variables added to this
    process's for the launcher and every process it starts; `tls_context`: None for plain
    HTTP."""

    def __init__(
        self,
        flags: list[str],
        ready_timeout_s: float = 300.0,
        quiet: bool = False,
        log_path: Path | None = None,
        port: int | None = None,
        environment: dict[str, str] | None = None,
    ):
        self.port = port or free_port()
        certfile = certificate_flag(flags)
        self.tls_context: ssl.SSLContext | None = (
            trusting_certificate(certfile) if certfile is not None else None
        )
        self.url = f"{'https' if certfile else 'http'}://127.0.0.1:{self.port}"
        self._log = open(log_path, "w") if log_path is not None else None  # noqa: SIM115
        output = self._log or (subprocess.DEVNULL if quiet else None)
        self.process = subprocess.Popen(
            [*python_module_command("pdserve.commands.cli"), "serve", "--port", str(self.port), *flags],
            stdout=output,
            stderr=output,
            env={**os.environ, **environment} if environment else None,
        )
        try:
            wait_healthy(
                self.url, lambda: self.process.poll() is not None, ready_timeout_s,
                self.tls_context,
            )
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


def certificate_flag(flags: list[str]) -> str | None:
    """The value of `--ssl-certfile` in `flags` (`--ssl-certfile F` or `--ssl-certfile=F`)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--ssl-certfile")
    return parser.parse_known_args(flags)[0].ssl_certfile
