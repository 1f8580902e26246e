"""The run-time planner (`--planner load`) under a load that shifts from long prompts to long
outputs: which roles the nodes take when, and whether any request is lost on the way.

    python -m pdserve.bench.planner_shift [--model PATH] [--out-dir DIR]

Deployment: `pdserve serve` with 1 prefill + 2 decode nodes (`--disagg-policy auto`, KV cache
`--kv-cache-memory` per node) and the planner's thresholds in PLANNER_FLAGS. Default model:
the tests' tiny random-weight Llama (testing/tiny_models.py), so the run measures the planner's
mechanics (drain, restart, nothing lost) and not the speed of a real model.
Load, closed loop (each client sends its next streaming request when the last one ends):
  long prompts  10 clients, 800-1,000 random tokens in, 4 out: the prefill node's queue
                grows while decode KV stays mostly free -> a decode node should become a
                prefill node;
  long outputs  96 clients, 16-32 tokens in (computed on the decode nodes under auto: the
                prefill queue empties), 300-600 out: decode KV fills -> a prefill node should
                become a decode node.
Each phase ends HOLD_S after the planner's next change is counted, or after PHASE_CAP_S. A
sampler reads every SAMPLE_S the router's signals (GET /admin/nodes, with the admin token of
the cluster secret the bench gives the deployment: router/api/admin.py) and the launcher's
planner lines. At the end every request's outcome is classified (bench/burst_streams.py) and
every live node must be idle with no leaked block (bench/node_metrics.py).
Writes planner_shift.md, .png and .json (bench/results/ unless `--out-dir`); formatting in
bench/planner_shift_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import secrets
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from pdserve.bench.burst_streams import Outcome, StreamRecord, absorb_event, classify, stream_into
from pdserve.bench.machine import command_line, load_average, machine_info
from pdserve.bench.node_metrics import parse_metric, wait_for_clean_kv
from pdserve.bench.planner_shift_report import plot, report
from pdserve.commands.router_admin import RouterAdmin, RouterAdminError
from pdserve.commands.serve_process import ServeProcess
from pdserve.wire.cluster_auth import SECRET_ENV, ClusterAuth

RESULTS = Path(__file__).parent / "results"
KV_CACHE_BYTES = 16 << 20
LAYOUT = ["--prefill", "1", "--decode", "2", "--disagg-policy", "auto"]
PLANNER_FLAGS = [
    "--planner", "load", "--planner-interval", "0.5", "--planner-sustain", "1",
    "--planner-min-dwell", "10", "--planner-prefill-delay-high", "0.15",
    "--planner-prefill-delay-low", "0.03", "--planner-kv-usage-high", "0.3",
    "--planner-kv-usage-low", "0.2",
]
PHASES = {  # name -> (clients, prompt tokens range, output tokens range)
    "long prompts": (10, (800, 1000), (4, 4)),
    "long outputs": (96, (16, 32), (300, 600)),  # varied, so streams do not end in step
}
HOLD_S = 15.0
PHASE_CAP_S = 150.0
SAMPLE_S = 0.5
REQUEST_TIMEOUT_S = 300.0

if TYPE_CHECKING:
    import aiohttp  # the bench extra: the GPU image and a bare install lack it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.planner_shift")
    parser.add_argument("--model", default=None, help="a model folder (default: the tiny one)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    return parser.parse_args(argv)


class Run:
    """What one run saw, times in seconds from its start."""

    def __init__(self, url: str, model: str, admin: RouterAdmin, log_path: Path) -> None:
        self.url, self.model, self.admin, self.log_path = url, model, admin, log_path
        self.start = time.perf_counter()
        self.requests: list[tuple[str, StreamRecord, int]] = []  # (phase, record, max_tokens)
        self.samples: list[dict] = []
        self.events: list[dict] = []  # the launcher's planner lines, as first seen
        self.phases: list[dict] = []
        self._log_offset = 0

    def now(self) -> float:
        return time.perf_counter() - self.start

    def changes(self) -> int:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return int(sum(parse_metric(text, "pdserve_planner_role_changes_total", "to").values()))

    def sample(self) -> None:
        """One reading of the router's signals and of the launcher's new planner lines."""
        now = self.now()
        try:
            signals = self.admin.signals(now)
        except RouterAdminError:
            return
        serving = {role: len(signals.serving(role)) for role in ("prefill", "decode")}
        self.samples.append({
            "t": now, **serving,
            "draining": [n.node_id for n in signals.nodes if n.live and not n.serving],
            "prefill_delay_s": signals.prefill_queue_delay_s,
            "decode_kv_usage": signals.decode_kv_usage,
            "decode_waiting": signals.decode_waiting,
        })
        with open(self.log_path, "rb") as log:
            log.seek(self._log_offset)
            data = log.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._log_offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if "pdserve: planner:" in line:
                self.events.append({"t": now, "line": line[line.index("pdserve: planner:"):]})

    async def sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(SAMPLE_S)

    async def client(
        self, http: aiohttp.ClientSession, phase: str, seed: int, stop: asyncio.Event
    ) -> None:
        _, (low, high), (fewest, most) = PHASES[phase]
        rng = random.Random(seed)
        while not stop.is_set():
            max_tokens = rng.randrange(fewest, most + 1)
            body = {
                "model": self.model,
                "prompt": [rng.randrange(3, 500) for _ in range(rng.randrange(low, high + 1))],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
            }
            record = StreamRecord(sent_s=self.now())
            self.requests.append((phase, record, max_tokens))
            absorb = functools.partial(absorb_event, record)
            await stream_into(record, http, "/v1/completions", body, self.start,
                              REQUEST_TIMEOUT_S, absorb)
            if record.status == 400:  # the bench's own request is wrong: no point going on
                raise RuntimeError(f"the server refused a request of the bench: {record.body}")

    async def phase(self, http: aiohttp.ClientSession, name: str, changes_before: int) -> None:
        stop = asyncio.Event()
        began = self.now()
        tasks = [
            asyncio.create_task(self.client(http, name, index, stop))
            for index in range(PHASES[name][0])
        ]
        changed_at = None
        while self.now() - began < PHASE_CAP_S:
            if await asyncio.to_thread(self.changes) > changes_before:
                changed_at = self.now()
                break
            await asyncio.sleep(SAMPLE_S)
        if changed_at is not None:
            await asyncio.sleep(HOLD_S)
        stop.set()
        await asyncio.gather(*tasks)
        self.phases.append({"name": name, "start": began, "end": self.now(),
                            "changed_at": changed_at})

    async def drive(self) -> None:
        import aiohttp

        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sampler(stop))
        connector = aiohttp.TCPConnector(limit=0)  # one connection per stream
        async with aiohttp.ClientSession(
            self.url, connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        ) as http:
            for name in PHASES:
                await self.phase(http, name, await asyncio.to_thread(self.changes))
        await asyncio.sleep(2 * SAMPLE_S)  # the last planner lines
        stop.set()
        await sampler

    def record(self) -> dict:
        """Outcomes counted per phase, the end time (0.1 s) of each completed request, every
        request not completed in full; signals to 3 decimals: the record stays small."""
        outcomes: dict[str, Counter] = {phase: Counter() for phase in PHASES}
        completed_end_s, not_completed = [], []
        for phase, record, max_tokens in self.requests:
            outcome, why = classify(record, max_tokens)
            outcomes[phase][outcome.value] += 1
            if outcome is Outcome.COMPLETED:
                completed_end_s.append(round(record.end_s, 1))
            else:
                not_completed.append({"phase": phase, "sent_s": round(record.sent_s, 2),
                                      "end_s": round(record.end_s, 2),
                                      "outcome": outcome.value, "why": why})
        samples = [
            {k: round(v, 3) if isinstance(v, float) else v for k, v in sample.items()}
            for sample in self.samples
        ]
        events = [{"t": round(e["t"], 2), "line": e["line"]} for e in self.events]
        return {"outcomes": {k: dict(v) for k, v in outcomes.items()},
                "completed_end_s": completed_end_s, "not_completed": not_completed,
                "samples": samples, "events": events, "phases": self.phases}


def tiny_model_folder() -> Path:
    from pdserve.testing.tiny_models import save_tiny_model

    return save_tiny_model("llama", Path(tempfile.mkdtemp(prefix="pdserve-planner-shift-")))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = Path(args.model) if args.model else tiny_model_folder()
    secret = secrets.token_urlsafe(32)
    os.environ[SECRET_ENV] = secret  # the deployment's, so the bench may read its signals
    flags = [str(model), *LAYOUT, "--kv-cache-memory", str(KV_CACHE_BYTES), *PLANNER_FLAGS]
    machine = machine_info()
    log_path = Path(tempfile.mkdtemp(prefix="pdserve-planner-shift-log-")) / "serve.log"
    server = ServeProcess(flags, log_path=log_path)
    try:
        admin = RouterAdmin(server.url, ClusterAuth.from_secret(secret).admin_token())
        run = Run(server.url, model.name, admin, log_path)
        asyncio.run(run.drive())
        settle = wait_for_clean_kv(server.url, 2.0, 60.0)
    finally:
        server.close()
    machine["load average at end"] = load_average()
    record = {
        "command": command_line(), "machine": machine, "serve_flags": flags[1:],
        "model": "tiny random-weight Llama (testing/tiny_models.py)" if not args.model
        else model.name,
        "phases_config": {k: list(v) for k, v in PHASES.items()}, "hold_s": HOLD_S,
        **run.record(), "settle": settle,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "planner_shift.json").write_text(json.dumps(record, separators=(",", ":")))
    plot(record, args.out_dir / "planner_shift.png")
    (args.out_dir / "planner_shift.md").write_text(report(record))
    lost = len(record["not_completed"])
    print(f"{len(record['completed_end_s']) + lost} requests, {lost} not completed; "
          f"{sum('changed node' in e['line'] for e in record['events'])} role changes; "
          f"report in {args.out_dir / 'planner_shift.md'}")


if __name__ == "__main__":
    main()
