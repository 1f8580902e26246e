"""KV transfer endpoints in their own process, driven by JSON lines: tests and benchmarks use
it to put the decode or prefill side of a transfer in a second, real process.

`python -m pdserve.kvtransfer.peer` reads one JSON command per line on stdin and answers each with
one
JSON line on stdout ({"ok": true, ...} or {"ok": false, "error": ...}); logs go to stderr. It
exits when stdin closes, closing every receiver and sender it opened (which unlinks the shared
memory segments it owns). `PeerProcess` starts one and talks to it with timeouts on every read.

Commands (every endpoint has a `name`):
  open_receiver  transport node_id spec num_blocks [grace device fingerprint] -> descriptor
                 (hex); spec = {num_layers, num_kv_heads, head_dim, block_size, dtype}
  open_sender    transport descriptor seed num_blocks [grant_timeout step_bytes window device
                 fingerprint]: a KV cache shaped as the descriptor says, filled with random
                 bytes drawn from `seed`
  expect         transfer_id block_ids deadline_s             (receiver)
  write          transfer_id src dst                          (sender)
  wait           transfer_id wait_s -> kind, error
  abort          transfer_id
  hashes         block_ids -> sha256 of each block's bytes, all layers
  held           -> blocks the receiver still holds
  close
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pdserve.wire.child_command import python_module_command

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FINGERPRINT = "unnamed-model"


def kv_spec(fields: dict[str, Any]):
    from pdserve.engine.kv.kv_cache import KVCacheSpec
    from pdserve.kvtransfer.descriptor import DTYPE_NAMES

    return KVCacheSpec(**{**fields, "dtype": DTYPE_NAMES[fields["dtype"]]})


def block_hashes(buffer, block_ids: list[int]) -> list[str]:
    import torch

    return [
        hashlib.sha256(
            buffer[:, :, b].contiguous().cpu().view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for b in block_ids
    ]


class Endpoints:
    def __init__(self) -> None:
        self.receivers: dict[str, Any] = {}
        self.senders: dict[str, Any] = {}
        self.caches: dict[str, Any] = {}

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        import torch

        from pdserve.engine.kv.kv_cache import KVCache
        from pdserve.kvtransfer import (
            ChannelReceiver,
            ChannelSender,
            KVDescriptor,
            ReceiverConfig,
            SenderConfig,
        )

        name, cmd = command.get("name", ""), command["cmd"]
        if cmd == "open_receiver":
            receiver = ChannelReceiver(
                command["transport"],
                ReceiverConfig(command["node_id"], release_grace_s=command.get("grace", 0.2)),
            )
            device = torch.device(command.get("device", "cpu"))
            cache = receiver.allocate_kv_cache(kv_spec(command["spec"]), command["num_blocks"], device)
            descriptor = receiver.register(cache, command.get("fingerprint", DEFAULT_FINGERPRINT))
            self.receivers[name], self.caches[name] = receiver, cache
            return {"descriptor": descriptor.encode().hex()}
        if cmd == "open_sender":
            descriptor = KVDescriptor.decode(bytes.fromhex(command["descriptor"]))
            device = torch.device(command.get("device", "cpu"))
            cache = KVCache(descriptor.spec, command["num_blocks"], device)
            generator = torch.Generator().manual_seed(command["seed"])
            random_bytes = torch.randint(
                0, 256, (cache.buffer.numel() * cache.buffer.element_size(),),
                dtype=torch.uint8, generator=generator,
            )
            cache.buffer.view(-1).view(torch.uint8).copy_(random_bytes.to(cache.buffer.device))
            config = SenderConfig(
                grant_timeout_s=command.get("grant_timeout", 2.0),
                step_bytes=command.get("step_bytes", 1 << 16),
                max_inflight_bytes=command.get("window", 1 << 17),
            )
            sender = ChannelSender(command["transport"], config)
            sender.connect(descriptor, cache, command.get("fingerprint", DEFAULT_FINGERPRINT))
            self.senders[name], self.caches[name] = sender, cache
            return {}
        endpoint = self.receivers.get(name) or self.senders.get(name)
        if cmd == "expect":
            deadline = time.monotonic() + command["deadline_s"]
            endpoint.expect(command["transfer_id"], command["block_ids"], deadline)
            return {}
        if cmd == "write":
            endpoint.write(
                command["transfer_id"], command["src"], command["dst"],
                layer_start=command.get("layer_start", 0), layer_end=command.get("layer_end"),
            )
            return {}
        if cmd == "wait":
            event = endpoint.wait(command["transfer_id"], command["wait_s"])
            return {"kind": event.kind.value, "error": event.error}
        if cmd == "abort":
            endpoint.abort(command["transfer_id"])
            return {}
        if cmd == "hashes":
            return {"hashes": block_hashes(self.caches[name].buffer, command["block_ids"])}
        if cmd == "held":
            return {"held": endpoint.held_block_count()}
        if cmd == "close":
            endpoint.close()
            self.receivers.pop(name, None)
            self.senders.pop(name, None)
            self.caches.pop(name, None)
            return {}
        raise ValueError(f"unknown command {cmd!r}")

    def close_all(self) -> None:
        for endpoint in [*self.senders.values(), *self.receivers.values()]:
            endpoint.close()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(message)s")
    endpoints = Endpoints()
    print(json.dumps({"ok": True, "pid": os.getpid()}), flush=True)
    try:
        for line in sys.stdin:
            try:
                answer = {"ok": True, **endpoints.run(json.loads(line))}
            except Exception as error:  # noqa: BLE001 (every failure is reported to the driver)
                answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            print(json.dumps(answer), flush=True)
    finally:
        endpoints.close_all()


class PeerProcess:
    """Drives one `python -m pdserve.kvtransfer.peer` process; every read has a timeout."""

    def __init__(self, stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "w")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            python_module_command("pdserve.kvtransfer.peer"),
            cwd=PROJECT_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True, bufsize=1,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()
        self._started = False

    def wait_started(self, timeout: float = 60.0) -> None:
        """Peers start in parallel: construct several, then wait for each."""
        if not self._started:
            self._answer(timeout)
            self._started = True

    def _read_lines(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _answer(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"peer {self.process.pid} did not answer in {timeout} s") from None
        if line is None:
            raise EOFError(f"peer {self.process.pid} exited: {self.stderr_text()[-2000:]}")
        return json.loads(line)

    def call(self, cmd: str, timeout: float = 20.0, **fields: Any) -> dict[str, Any]:
        self.wait_started()
        self.process.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
        self.process.stdin.flush()
        answer = self._answer(timeout)
        if not answer.pop("ok"):
            raise RuntimeError(f"peer {cmd} failed: {answer['error']}")
        return answer

    def stderr_text(self) -> str:
        return self.stderr_path.read_text()

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.alive():
            try:
                self.process.stdin.close()
                self.process.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._stderr.close()


if __name__ == "__main__":
    main()
