"""One request to `pdserve serve` on the default model, as a new user makes it, and a Ctrl-C.

`make test-newest` runs this in the environment resolved to the newest packages pip offers, so a
release that breaks serving shows up in CI rather than on a user's first `make serve`:

    python -P tests/serve_smoke.py [--timeout SECONDS]

It starts the environment's `pdserve serve` (default model, 1 prefill + 1 decode) from the
repository root as `make serve` does, asks one greedy chat completion whose answer must name
Paris, then stops the deployment as a terminal's Ctrl-C does (SIGINT to its process group) and
checks that the stop was quiet: exit status 0 or 130 and no traceback. It prints what each stage
took and exits 1 naming the stage that failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.wire.free_ports import free_port

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France? Answer in one sentence."
EXPECTED = "Paris"


def wait_for(path: Path, text: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text(errors="replace"):
        if server.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with status {server.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"pdserve serve did not say {text!r} within {timeout_s:.0f} s")
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=600.0, help="for each stage, seconds")
    args = parser.parse_args()
    pdserve = Path(sys.executable).parent / "pdserve"
    port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="pdserve-smoke-"))
    stdout_path, stderr_path = logs / "stdout.txt", logs / "stderr.txt"
    stage, began = "start", time.monotonic()
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        server = subprocess.Popen(
            [str(pdserve), "serve", "--port", str(port)], cwd=ROOT, stdout=stdout, stderr=stderr,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )
    try:
        wait_for(stdout_path, "pdserve is serving", server, args.timeout)
        print(f"serve-smoke: ready in {time.monotonic() - began:.0f} s", flush=True)
        stage, began = "request", time.monotonic()
        body = {
            "model": "default", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 32, "temperature": 0,
        }
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        body["model"] = models["data"][0]["id"]
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=args.timeout
        )
        response.raise_for_status()
        answer = response.json()["choices"][0]["message"]["content"]
        print(f"serve-smoke: {body['model']} answered {answer!r} in "
              f"{time.monotonic() - began:.1f} s", flush=True)
        if EXPECTED not in answer:
            raise RuntimeError(f"the answer does not name {EXPECTED}")
        stage, began = "Ctrl-C", time.monotonic()
        os.killpg(server.pid, signal.SIGINT)
        status = server.wait(args.timeout)
        said = stdout_path.read_text(errors="replace") + stderr_path.read_text(errors="replace")
        if status not in (0, 130, -signal.SIGINT):
            raise RuntimeError(f"pdserve serve exited with status {status} after SIGINT")
        if "Traceback" in said:
            raise RuntimeError("pdserve serve printed a traceback when stopped")
        print(f"serve-smoke: stopped quietly (status {status}) in "
              f"{time.monotonic() - began:.1f} s", flush=True)
        return 0
    except (RuntimeError, httpx.HTTPError, subprocess.TimeoutExpired, KeyError) as error:
        print(f"serve-smoke: FAILED at {stage}: {error}", file=sys.stderr)
        for path in (stdout_path, stderr_path):
            print(f"--- {path.name} (last 40 lines)", file=sys.stderr)
            print("\n".join(path.read_text(errors="replace").splitlines()[-40:]), file=sys.stderr)
        return 1
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


if __name__ == "__main__":
    sys.exit(main())
