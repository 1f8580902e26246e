"""Soak: a deployment under mixed streaming traffic for many minutes on a loaded host, then the
checks that it ends clean and still notices a dead node.

    python -m pdserve.bench.soak [--minutes 30] [--deployment 1p1d] [--concurrency 16]
                                 [--loaded | --idle] [--out-dir DIR] [--seed 0] [--server-log F]

Stages, in order:
  start       one `pdserve serve` (the deployment's flags as bench/sweep.py names them, the
              default model), warmed up with two short requests;
  load        with --loaded (the default), one busy-looping process per usable core
              (bench/cpu_hog.py's `busy_cores`) from here until the traffic ends;
  traffic     --concurrency clients on one asyncio loop, each sending one streamed request after
              another until --minutes have passed, then finishing the one it has in flight (at
              most CLIENT_TIMEOUT_S more). The kinds, drawn with equal odds from a seeded
              generator, are in KINDS; every one asks for 8-32 tokens. Meanwhile /metrics is
              scraped every SCRAPE_INTERVAL_S: a node whose `pdserve_node_up` is not 1 while its
              process (found through /proc, bench/server_processes.py) is alive is a node-down
              event, counted once per fall;
  settle      the hog stopped, every live node's KV usage must return to 0 and its leaked blocks
              to 0 and stay so for SETTLED_S (within SETTLE_TIMEOUT_S);
  kill -9     the decode node's process is killed; detection time: the kill to the first scrape
              of the router's /metrics that shows it down (`pdserve_node_up` 0, or gone),
              scraped every KILL_POLL_S.

Every request ends in exactly one outcome (a token: a streamed choice with text or a
finish_reason; the chat stream's opening role chunks are not tokens):
  completed           HTTP 200 and a finish_reason for every one of its n choices
  refused             429 or 503, or an error event before any token
  died after a token  an error event, a cut connection, or an end without every finish_reason,
                      after a token: must be 0
  timed out           not ended CLIENT_TIMEOUT_S after its send (the client gives up)
  failed              anything else (another status, no answer, a stream cut before a token)
TTFT: send to the first token, of completed requests; time to refusal: send to the end of the
answer. Writes soak.md and soak.json to --out-dir (bench/results by default) and prints soak.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from pdserve.bench.burst_streams import Outcome, outcome_unless_ended, stream_into
from pdserve.bench.node_metrics import parse_metric, wait_for_clean_kv
from pdserve.bench.serve_metrics import percentile
from pdserve.bench.server_processes import server_processes
from pdserve.bench.sweep import CONFIGS as DEPLOYMENTS
from pdserve.bench.sweep import say

RESULTS = Path(__file__).parent / "results"
CLIENT_TIMEOUT_S = 300.0
WARMUP_REQUESTS = 2
SCRAPE_INTERVAL_S = 3.0
PROGRESS_EVERY_S = 60.0
HEARTBEAT_S = 0.5  # the nodes' default --heartbeat-interval
SETTLED_S = 4 * HEARTBEAT_S  # each idle node sends stats taken after a leak check within this
SETTLE_TIMEOUT_S = 120.0
KILL_POLL_S = 0.05
KILL_TIMEOUT_S = 60.0
MAX_TOKENS = (8, 32)
LONG_PROMPT_TOKENS = (1_000, 4_000)
N_CHOICES = (2, 4)
CHAT_PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Count from one to five.",
    "Give me a synonym for quick.",
    "What is 12 times 7?",
)
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
CHOICES = ["yes", "no", "maybe"]
KINDS = {
    "chat": "/v1/chat/completions, a short question",
    "long prompt": "/v1/completions, 1,000-4,000 random token ids as `prompt`, EOS ignored",
    "n choices": "/v1/completions, 64 random token ids, n=2..4, temperature 1, EOS ignored",
    "json_schema": "/v1/chat/completions, `response_format` json_schema {name, age}",
    "guided_choice": f"/v1/chat/completions, `guided_choice` {CHOICES}",
}

if TYPE_CHECKING:
    import aiohttp  # the bench extra: the GPU image and a bare install lack it


# -- the requests -------------------------------------------------------------------------------


def request_body(kind: str, rng: random.Random, model: str, vocab: list[int]) -> tuple[str, dict]:
    """(path, body) of one request of `kind`, drawn from `rng`."""
    common = {"model": model, "max_tokens": rng.randint(*MAX_TOKENS), "stream": True}
    chat = {"messages": [{"role": "user", "content": rng.choice(CHAT_PROMPTS)}]}
    if kind == "chat":
        return "/v1/chat/completions", {**common, **chat, "temperature": 0}
    if kind == "long prompt":
        prompt = rng.choices(vocab, k=rng.randint(*LONG_PROMPT_TOKENS))
        return "/v1/completions", {**common, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    if kind == "n choices":
        body = {"prompt": rng.choices(vocab, k=64), "n": rng.randint(*N_CHOICES)}
        return "/v1/completions", {**common, **body, "temperature": 1.0, "ignore_eos": True}
    if kind == "json_schema":
        schema = {"name": "person", "schema": PERSON_SCHEMA}
        answer = {"response_format": {"type": "json_schema", "json_schema": schema}}
        return "/v1/chat/completions", {**common, **chat, **answer, "temperature": 0}
    if kind == "guided_choice":
        return "/v1/chat/completions", {**common, **chat, "guided_choice": CHOICES}
    raise ValueError(f"unknown request kind {kind!r}; expected one of {', '.join(KINDS)}")


@dataclass
class SoakRecord:
    """What one request saw; times in seconds from the traffic start."""

    kind: str
    n: int
    sent_s: float
    status: int | None = None  # None: no HTTP answer arrived
    first_token_s: float | None = None
    end_s: float = 0.0
    finish_reasons: dict[int, str] = field(default_factory=dict)
    error_event: str = ""  # its first 120 characters
    exception: str = ""  # the connection failed, or was cut mid-stream
    timed_out: bool = False
    body: str = ""  # the start of a non-200 answer

    def absorb(self, data: str, now_s: float) -> None:
        """One SSE `data:` payload of a completions or chat completions stream."""
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if chunk.get("error"):
            error = chunk["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            self.error_event = str(message)[:120]
            return
        for choice in chunk.get("choices") or []:
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if (text or choice.get("finish_reason")) and self.first_token_s is None:
                self.first_token_s = now_s
            if choice.get("finish_reason"):
                self.finish_reasons[choice["index"]] = choice["finish_reason"]


def classify(record: SoakRecord) -> tuple[Outcome, str]:
    """The request's one outcome and what, if not completed, ended it."""
    if record.timed_out:
        return Outcome.TIMED_OUT, "no end within the client timeout"
    if (cut_short := outcome_unless_ended(record, "a token")) is not None:
        return cut_short
    if len(record.finish_reasons) < record.n:
        return Outcome.DIED, f"{len(record.finish_reasons)} of {record.n} choices finished"
    return Outcome.COMPLETED, ""


async def send_one(
    http: aiohttp.ClientSession, kind: str, path: str, body: dict, start: float, timeout_s: float
) -> SoakRecord:
    record = SoakRecord(kind, body.get("n", 1), time.perf_counter() - start)
    await stream_into(record, http, path, body, start, timeout_s, record.absorb)
    return record


async def client_loop(
    http: aiohttp.ClientSession,
    rng: random.Random,
    model: str,
    vocab: list[int],
    stop_at: float,
    start: float,
    records: list[SoakRecord],
) -> None:
    """One client: a request after another until `stop_at` (perf_counter)."""
    while time.perf_counter() < stop_at:
        kind = rng.choice(list(KINDS))
        path, body = request_body(kind, rng, model, vocab)
        records.append(await send_one(http, kind, path, body, start, CLIENT_TIMEOUT_S))


# -- what /metrics says about the nodes ---------------------------------------------------------


def node_label(node_id: str) -> str:
    """`decode-0.8123` -> `decode-0`, the label bench/server_processes.py gives its process."""
    return node_id.split(".")[0]


def process_alive(pid: int | None) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class NodeWatch:
    """What the scrapes during the traffic saw."""

    scrapes: int = 0
    failed_scrapes: list[str] = field(default_factory=list)
    down_while_alive: list[dict] = field(default_factory=list)  # one per fall
    replaced: list[str] = field(default_factory=list)  # a node's process changed (it restarted)
    _down: set[str] = field(default_factory=set)

    def observe(self, up: dict[str, float], pids: dict[str, int], first_pids: dict[str, int],
                now_s: float) -> None:
        for node_id, value in up.items():
            label = node_label(node_id)
            if value == 1.0 or not process_alive(pids.get(label)):
                self._down.discard(node_id)
            elif node_id not in self._down:
                self._down.add(node_id)
                self.down_while_alive.append({"node": node_id, "at_s": round(now_s, 1)})
        for label, pid in pids.items():
            if label in first_pids and first_pids[label] != pid and label not in self.replaced:
                self.replaced.append(label)


async def watch_nodes(url: str, launcher_pid: int, start: float, watch: NodeWatch) -> None:
    """Scrapes /metrics every SCRAPE_INTERVAL_S into `watch` until cancelled."""
    first_pids = server_processes(launcher_pid)
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while True:
            now_s = time.perf_counter() - start
            try:
                text = (await http.get("/metrics")).text
            except httpx.HTTPError as error:
                watch.failed_scrapes.append(f"{now_s:.0f} s: {type(error).__name__}")
            else:
                pids = await asyncio.to_thread(server_processes, launcher_pid)
                watch.observe(parse_metric(text, "pdserve_node_up"), pids, first_pids, now_s)
                watch.scrapes += 1
            await asyncio.sleep(SCRAPE_INTERVAL_S)


async def report_progress(records: list[SoakRecord], start: float) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        counts = Counter(classify(r)[0].value for r in records)
        done = ", ".join(f"{n} {outcome}" for outcome, n in counts.most_common())
        minutes = (time.perf_counter() - start) / 60
        say(f"{minutes:.0f} min: {len(records)} ended ({done or 'none'})")


async def run_traffic(
    url: str, model: str, vocab: list[int], args: argparse.Namespace, launcher_pid: int
) -> tuple[list[SoakRecord], NodeWatch, float]:
    """The traffic stage: records, what the scrapes saw, and its length in seconds."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    records: list[SoakRecord] = []
    watch = NodeWatch()
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as http:
        start = time.perf_counter()
        stop_at = start + args.minutes * 60
        watcher = asyncio.create_task(watch_nodes(url, launcher_pid, start, watch))
        progress = asyncio.create_task(report_progress(records, start))
        try:
            await asyncio.gather(
                *(
                    client_loop(http, random.Random(f"soak-{args.seed}-{client}"), model, vocab,
                                stop_at, start, records)
                    for client in range(args.concurrency)
                )
            )
        finally:
            watcher.cancel()
            progress.cancel()
    return records, watch, time.perf_counter() - start


# -- the end: settle, then kill -9 ---------------------------------------------------------------


def kill_detection(url: str, launcher_pid: int) -> dict:
    """kill -9 of the decode node (or the last node where there is none); seconds until the
    router's /metrics shows it down."""
    nodes = {k: v for k, v in server_processes(launcher_pid).items() if k != "router"}
    if not nodes:
        return {"error": "no node process found"}
    label = next((k for k in nodes if k.startswith("decode")), list(nodes)[-1])
    os.kill(nodes[label], signal.SIGKILL)
    killed = time.perf_counter()
    while (waited := time.perf_counter() - killed) < KILL_TIMEOUT_S:
        with contextlib.suppress(httpx.HTTPError):
            up = parse_metric(httpx.get(f"{url}/metrics", timeout=5).text, "pdserve_node_up")
            shown = [value for node, value in up.items() if node_label(node) == label]
            if not shown or 0.0 in shown:
                return {"node": label, "pid": nodes[label], "detected_s": waited}
        time.sleep(KILL_POLL_S)
    return {"node": label, "pid": nodes[label], "error": f"not shown down in {KILL_TIMEOUT_S:g} s"}


# -- the summary and the command ----------------------------------------------------------------


def summarize(records: list[SoakRecord]) -> dict:
    """Per kind and for all: counts per outcome, refusals by kind, TTFT and refusal times."""

    def one(group: list[SoakRecord]) -> dict:
        classified = [(r, *classify(r)) for r in group]
        counts = Counter(outcome for _, outcome, _ in classified)
        ttfts = [r.first_token_s - r.sent_s for r, o, _ in classified if o is Outcome.COMPLETED]
        refusals = [r.end_s - r.sent_s for r, o, _ in classified if o is Outcome.REFUSED]
        reasons = Counter(f"{o.value}: {why}" for _, o, why in classified if why)
        return {
            "requests": len(group),
            **{outcome.name.lower(): counts[outcome] for outcome in Outcome},
            "refused_by": dict(Counter(d for _, o, d in classified if o is Outcome.REFUSED)),
            "not_completed": dict(reasons.most_common(10)),
            "ttft_p50": percentile(ttfts, 50),
            "ttft_p99": percentile(ttfts, 99),
            "refusal_p50": percentile(refusals, 50),
            "refusal_p99": percentile(refusals, 99),
        }

    by_kind = {kind: one([r for r in records if r.kind == kind]) for kind in KINDS}
    return {**by_kind, "all": one(records)}


def warm_up(url: str, model: str, vocab: list[int], seed: int) -> None:
    from pdserve.bench.serve_datasets import warmup_requests

    for request in warmup_requests(WARMUP_REQUESTS, vocab, seed):
        body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens}
        httpx.post(f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S).raise_for_status()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="traffic stage length")
    parser.add_argument("--deployment", default="1p1d", choices=list(DEPLOYMENTS))
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent client streams")
    parser.add_argument("--out-dir", default=str(RESULTS), help="where soak.md/.json go")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--loaded", dest="loaded", action="store_true", default=True,
                      help="one busy-looping process per usable core during the traffic (default)")
    load.add_argument("--idle", dest="loaded", action="store_false", help="no busy processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-log", default=None, help="file for the server's output")
    args = parser.parse_args(argv)
    if not args.minutes > 0:
        parser.error(f"--minutes is {args.minutes}; expected a positive number")
    if args.concurrency < 1:
        parser.error(f"--concurrency is {args.concurrency}; expected at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """The stages above; exit status 1 when a request died after a token, the KV did not settle
    clean, a node fell while its process was alive, or the kill -9 found no node or went
    unnoticed."""
    import shlex

    from pdserve.bench.burst import write_report
    from pdserve.bench.cpu_hog import busy_cores, usable_cores
    from pdserve.bench.machine import load_average, machine_info
    from pdserve.bench.serve_load import discover_model
    from pdserve.bench.serve_report import json_safe
    from pdserve.bench.serve_vocab import load_vocabulary
    from pdserve.bench.soak_report import markdown
    from pdserve.commands.serve_process import ServeProcess
    from pdserve.model_store.default_model import ensure_default_model

    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    machine = machine_info()
    vocab = load_vocabulary(str(ensure_default_model()), None).ids
    flags = DEPLOYMENTS[args.deployment]
    say(f"{args.deployment}: pdserve serve {' '.join(flags)}")
    log_path = Path(args.server_log) if args.server_log else None
    server = ServeProcess(flags, quiet=True, log_path=log_path)
    try:
        model = discover_model(server.url)
        warm_up(server.url, model, vocab, args.seed)
        hogs = usable_cores() if args.loaded else 0
        say(f"{hogs} busy processes; {args.concurrency} clients for {args.minutes:g} min")
        with busy_cores() if args.loaded else contextlib.nullcontext():
            machine["load average, traffic start"] = load_average()
            records, watch, traffic_s = asyncio.run(
                run_traffic(server.url, model, vocab, args, server.process.pid)
            )
            machine["load average, traffic end"] = load_average()
        say(f"traffic ended after {traffic_s:.0f} s, {len(records)} requests; settling")
        settle = wait_for_clean_kv(server.url, SETTLED_S, SETTLE_TIMEOUT_S)
        say(f"KV {'clean' if settle['clean'] else 'NOT clean'} after {settle['waited_s']:.1f} s")
        kill = kill_detection(server.url, server.process.pid)
        shown = f"{kill['detected_s']:.2f} s" if "detected_s" in kill else kill.get("error")
        say(f"kill -9 of {kill.get('node')}: shown down after {shown}")
    finally:
        server.close()
    leaked = [v["leaked_blocks"] for v in settle["nodes"].values()]
    result = json_safe(
        {
            "command": shlex.join(["python", "-m", "pdserve.bench.soak", *raw]),
            "machine": machine,
            "setup": {
                "deployment": f"{args.deployment}: `pdserve serve {' '.join(flags)}`, "
                "the default model (SmolLM2-135M-Instruct)",
                "traffic": f"{args.minutes:g} min, then the requests in flight finish",
                "clients": f"{args.concurrency} concurrent streams, aiohttp, one asyncio loop",
                "host load": f"{hogs} busy-looping processes (one per usable core)"
                if args.loaded else "none (--idle)",
                "request kinds (equal odds)": "; ".join(f"{k}: {v}" for k, v in KINDS.items()),
                "tokens out": f"{MAX_TOKENS[0]}-{MAX_TOKENS[1]}, streamed",
                "client timeout": f"{CLIENT_TIMEOUT_S:g} s",
                "seed": args.seed,
            },
            "traffic_s": traffic_s,
            "outcomes": summarize(records),
            "settle": settle,
            "leaked_blocks_at_end": sum(v for v in leaked if v is not None)
            if leaked and None not in leaked else None,
            "nodes": {
                "scrapes": watch.scrapes,
                "failed_scrapes": watch.failed_scrapes,
                "down_while_alive": watch.down_while_alive,
                "replaced_processes": watch.replaced,
            },
            "kill": kill,
        }
    )
    write_report(args.out_dir, "soak", result, markdown(result))
    bad = result["outcomes"]["all"]["died"] or not settle["clean"] or watch.down_while_alive
    return 1 if bad or "error" in kill else 0


if __name__ == "__main__":
    sys.exit(main())
