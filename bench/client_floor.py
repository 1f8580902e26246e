"""The burst bench's client floor: its bursts against a server that refuses every request at once.

The server (this module's command) reads each request's head and body and answers 429 with an
OpenAI-shaped error, doing nothing else, in one uvloop loop (plain asyncio where uvloop is
missing). A burst against it measures what the client alone costs: the time to refusal no
server could beat with that client on that host, idle or loaded like the deployments' runs
(bench/burst.py runs it after them; its report sets each deployment's refusals beside it).

    python -P -m pdserve.bench.client_floor --port 8321   # prints "ready" once listening
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time

ERROR_BODY = json.dumps(
    {"error": {"message": "refused at once", "type": "rate_limit_exceeded", "code": 429}}
).encode()
RESPONSE = (
    b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n" % len(ERROR_BODY)
) + ERROR_BODY
MAX_HEAD_BYTES = 65536
LISTEN_BACKLOG = 4096


async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads one request (its head, then content-length bytes) and answers 429."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await reader.readexactly(length)
        writer.write(RESPONSE)
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError):
        pass
    finally:
        writer.close()


async def serve(port: int) -> None:
    server = await asyncio.start_server(
        refuse, "127.0.0.1", port, backlog=LISTEN_BACKLOG, limit=MAX_HEAD_BYTES
    )
    print("ready", flush=True)
    await server.serve_forever()


def run_client_floor(
    bodies_by_burst: dict[int, list[dict]], timeout_s: float, loaded_host: bool, settle_s: float
) -> dict:
    """Each burst against a fresh instant-refusal server, with every usable core kept busy
    when `loaded_host` (bench/cpu_hog.py): per burst size, its refusals' P50/P99, when the
    last request was written and the client's CPU time."""
    from pdserve.bench.burst import run_async, send_burst
    from pdserve.bench.burst_streams import summarize
    from pdserve.bench.cpu_hog import busy_cores
    from pdserve.wire.free_ports import free_port

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-P", "-m", "pdserve.bench.client_floor", "--port", str(port)],
        stdout=subprocess.PIPE, text=True,
    )
    floor: dict = {}
    try:
        if server.stdout is None or server.stdout.readline().strip() != "ready":
            return {"error": f"the instant-refusal server did not start ({server.poll()})"}
        with busy_cores() if loaded_host else contextlib.nullcontext([]):
            for index, (size, bodies) in enumerate(bodies_by_burst.items()):
                if index:
                    time.sleep(settle_s)
                cpu_start = time.process_time()
                records, _ = run_async(send_burst(f"http://127.0.0.1:{port}", bodies, timeout_s))
                summary = summarize(records, 1)
                floor[str(size)] = {
                    "refused": summary["refused"],
                    "refusal_p50": summary["refusal_p50"],
                    "refusal_p99": summary["refusal_p99"],
                    "last_written_s": summary["last_written_s"],
                    "client_cpu_s": time.process_time() - cpu_start,
                }
    finally:
        server.kill()
        server.wait()
    return floor


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.port))
    else:
        uvloop.run(serve(args.port))


if __name__ == "__main__":
    main()
