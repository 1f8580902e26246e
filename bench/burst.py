"""Burst benchmark: N streaming completions sent at the same instant, against deployments this
script starts fresh, one after the other.

    python -m pdserve.bench.burst [--bursts 100,300,1000] [--deployments colocated,1p1d]
                          [--prompt-len 140] [--max-tokens 16] [--model DIR] [--timeout 300]
                          [--server-arg=--max-queued-requests=256 ...] [--out-dir DIR]
                          [--loaded-host no|also|only]

Each deployment is one `pdserve serve` (flags as bench/sweep.py names them), warmed up with two
short requests, then given each burst in the order given, with a 2 s pause between them, and
stopped before the next deployment starts. With --loaded-host also, each deployment runs twice,
idle and then on a loaded host, "1p1d (loaded host)": started afresh and warmed up as before,
then given its bursts while one busy-looping process per usable core runs beside it at normal
priority (bench/cpu_hog.py), started after the warm-up and stopped after the last burst, as on
a GPU host whose CPUs are shared; --loaded-host only runs just that. A burst is N distinct random token-id prompts
(bench/serve_datasets.py) streamed from /v1/completions with ignore_eos, all sent at once from
one asyncio loop (uvloop when installed). Every request ends in exactly one outcome:

  completed           HTTP 200, the asked-for tokens and a finish_reason
  refused             429 or 503 before any token, or a 200 stream whose first news is an
                      error event; time to refusal: send to the end of that answer
  died after a token  a 200 stream that sent a token and then an error event or a cut
                      connection, or ended short without a finish_reason: must be 0
  timed out           still running --timeout seconds after its send (the client gives up)
  failed              anything else: another status, no answer at all, a stream cut before its
                      first token, a finish_reason after too few tokens

TTFT: send to the first streamed choice. Drain: burst start to the end of the last answer.
Peak RSS of the router and of each node: the largest VmRSS in /proc/PID/status sampled every
100 ms during the burst (VmHWM, the peak since the process started, goes to the JSON). Client
floor: the same bursts against a server that refuses every request at once
(bench/client_floor.py), on each host the deployments ran on. Writes burst.md and burst.json to
--out-dir (bench/results by default).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from pdserve.bench.burst_report import markdown
from pdserve.bench.burst_streams import StreamRecord, absorb_event, stream_into, summarize
from pdserve.bench.client_floor import run_client_floor
from pdserve.bench.cpu_hog import busy_cores
from pdserve.bench.server_processes import (
    cpu_seconds,
    sample_rss,
    sample_rss_every,
    server_processes,
    status_kib,
)
from pdserve.bench.sweep import CONFIGS as DEPLOYMENTS
from pdserve.bench.sweep import say
from pdserve.commands.serve_process import ServeProcess

RESULTS = Path(__file__).parent / "results"
WARMUP_REQUESTS = 2
SETTLE_S = 2.0
SAMPLE_INTERVAL_S = 0.1
LOADED_HOST_RUNS = {"no": (False,), "also": (False, True), "only": (True,)}
LOADED_LABEL = " (loaded host)"

if TYPE_CHECKING:
    import aiohttp



def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _one(
    http: aiohttp.ClientSession, body: dict, start: float, timeout_s: float
) -> StreamRecord:
    record = StreamRecord(sent_s=time.perf_counter() - start)
    absorb = functools.partial(absorb_event, record)
    await stream_into(record, http, "/v1/completions", body, start, timeout_s, absorb, record)
    return record


async def _body_written(_session: object, context: SimpleNamespace, _params: object) -> None:
    """aiohttp's trace hook for a request's last body chunk: the record notes the time."""
    record: StreamRecord = context.trace_request_ctx
    record.written_s = time.perf_counter() - context.start


async def send_burst(
    url: str, bodies: list[dict], timeout_s: float, pids: dict[str, int] | None = None
) -> tuple[list[StreamRecord], dict[str, int]]:
    """Sends every body at once; returns one record per body (in order) and the peak VmRSS
    (KiB) of each process in `pids` while they ran. One connection per stream, from one
    aiohttp session."""
    import aiohttp

    peaks: dict[str, int] = {}
    tracing = aiohttp.TraceConfig(
        trace_config_ctx_factory=lambda trace_request_ctx: SimpleNamespace(
            trace_request_ctx=trace_request_ctx, start=start
        )
    )
    tracing.on_request_chunk_sent.append(_body_written)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(
        url, connector=connector, timeout=timeout, trace_configs=[tracing]
    ) as http:
        sampler = asyncio.create_task(sample_rss_every(SAMPLE_INTERVAL_S, pids or {}, peaks))
        start = time.perf_counter()
        records = await asyncio.gather(*(_one(http, body, start, timeout_s) for body in bodies))
        sampler.cancel()
    sample_rss(pids or {}, peaks)
    return list(records), peaks


def event_loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run_async(coroutine):
    if event_loop_name() == "uvloop":
        import uvloop

        return uvloop.run(coroutine)
    return asyncio.run(coroutine)


# -- the server and its processes -----------------------------------------------------------


def raise_open_file_limit(needed: int) -> None:
    """One socket per stream on either side; the servers started here inherit the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < needed:
        say(f"open files are limited to {want:,} (hard limit); a burst may need {needed:,}")


# -- one deployment, every burst ------------------------------------------------------------


def run_burst(
    server: ServeProcess, model: str, prompts: list[list[int]], args: argparse.Namespace
) -> dict:
    bodies = [completion_body(model, prompt, args.max_tokens) for prompt in prompts]
    pids = server_processes(server.process.pid)
    before = {label: status_kib(pid, "VmRSS") for label, pid in pids.items()}
    cpu_start = time.process_time()
    router_cpu_start = cpu_seconds(pids["router"]) if "router" in pids else None
    records, peaks = run_async(send_burst(server.url, bodies, args.timeout, pids))
    summary = summarize(records, args.max_tokens)
    summary["client_cpu_s"] = time.process_time() - cpu_start
    router_cpu_end = cpu_seconds(pids["router"]) if "router" in pids else None
    summary["router_cpu_s"] = (
        router_cpu_end - router_cpu_start
        if router_cpu_start is not None and router_cpu_end is not None
        else None
    )
    summary["memory_kib"] = {
        label: {"before": before[label], "peak": peaks.get(label), "hwm": status_kib(pid, "VmHWM")}
        for label, pid in pids.items()
    }
    after = server_processes(server.process.pid)
    summary["replaced_processes"] = sorted(k for k, pid in pids.items() if after.get(k) != pid)
    return summary


def run_label(name: str, loaded_host: bool) -> str:
    return f"{name}{LOADED_LABEL}" if loaded_host else name


def run_deployment(
    name: str,
    args: argparse.Namespace,
    prompts_by_burst: dict[int, list[list[int]]],
    vocab: list[int],
    loaded_host: bool = False,
) -> dict:
    """One fresh server of deployment `name`, warmed up, then every burst; with `loaded_host`,
    the bursts run while every usable core is kept busy (started after the warm-up)."""
    from pdserve.bench.machine import load_average
    from pdserve.bench.serve_datasets import warmup_requests
    from pdserve.bench.serve_load import discover_model

    label = run_label(name, loaded_host)
    model_flags = ["--model", args.model] if args.model else []
    flags = [*model_flags, *DEPLOYMENTS[name], *args.server_arg]
    say(f"{label}: pdserve serve {' '.join(flags)}")
    logs = None
    if args.server_logs:
        Path(args.server_logs).mkdir(parents=True, exist_ok=True)
        logs = Path(args.server_logs) / f"burst-{name}{'-loaded' if loaded_host else ''}.log"
    deployment: dict = {
        "deployment": name,
        "loaded_host": loaded_host,
        "flags": flags,
        "bursts": {},
    }
    try:
        server = ServeProcess(flags, quiet=True, log_path=logs, port=args.port)
    except RuntimeError as error:
        deployment["error"] = f"the server did not start ({error})"
        say(f"{label}: {deployment['error']}")
        return deployment
    try:
        model = discover_model(server.url)
        warmup = [
            completion_body(model, r.prompt, r.max_tokens)
            for r in warmup_requests(WARMUP_REQUESTS, vocab, args.seed)
        ]
        run_async(send_burst(server.url, warmup, args.timeout))
        load = {"before bursts": load_average()}
        deployment["load_average"] = load
        with busy_cores() if loaded_host else contextlib.nullcontext([]) as hogs:
            deployment["busy_processes"] = len(hogs)
            if hogs:
                say(f"{label}: {len(hogs)} busy-looping processes started")
            for index, (size, prompts) in enumerate(prompts_by_burst.items()):
                if index:
                    time.sleep(SETTLE_S)
                summary = run_burst(server, model, prompts, args)
                deployment["bursts"][str(size)] = summary
                say(
                    f"{label}, burst {size}: {summary['completed']} completed, "
                    f"{summary['refused']} refused, {summary['died']} died after a token, "
                    f"{summary['timed_out']} timed out, {summary['failed']} failed; "
                    f"drained in {summary['drain_s']:.1f} s"
                )
                if server.process.poll() is not None:
                    deployment["error"] = f"the server exited ({server.process.returncode})"
                    break
            load["after bursts"] = load_average()
    finally:
        server.close()
    return deployment


def write_report(out_dir: str, name: str, result: dict, text: str) -> None:
    """Prints the markdown report `text` and writes it and the JSON record `result` to
    OUT_DIR/NAME.md and OUT_DIR/NAME.json (bench/soak.py's too)."""
    print(text)
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.md").write_text(text)
    (folder / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    say(f"wrote {name}.md and {name}.json to {folder}")


def _positive_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"{text!r} is not a list of positive integers, e.g. 100,300,1000")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.burst",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--bursts", default="100,300,1000", help="requests per burst")
    parser.add_argument("--deployments", default="colocated,1p1d", help=", ".join(DEPLOYMENTS))
    parser.add_argument("--prompt-len", type=int, default=140, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens out (EOS ignored)")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more `pdserve serve` flag for every deployment, with '=': "
        "--server-arg=--max-queued-requests=256 (repeatable)",
    )
    parser.add_argument("--port", type=int, default=None, help="the router's (default: a free one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-logs", default=None, help="folder for each server's output")
    parser.add_argument("--out-dir", default=str(RESULTS), help="where burst.md/.json go")
    parser.add_argument(
        "--loaded-host",
        choices=list(LOADED_HOST_RUNS),
        default="no",
        help="also (or only) run each deployment's bursts with every usable core kept busy by "
        "a busy-looping process per core, labelled '(loaded host)' (default: no)",
    )
    parser.add_argument(
        "--client-floor",
        choices=["yes", "no"],
        default="yes",
        help="also send each burst to a server that refuses at once (bench/client_floor.py), "
        "on each host the deployments ran on: what the client alone costs (default: yes)",
    )
    args = parser.parse_args(argv)
    try:
        args.bursts = _positive_ints(args.bursts)
    except ValueError as error:
        parser.error(f"--bursts: {error}")
    args.deployments = [name.strip() for name in args.deployments.split(",") if name.strip()]
    unknown = [name for name in args.deployments if name not in DEPLOYMENTS]
    if unknown or not args.deployments:
        parser.error(f"--deployments {unknown or 'is empty'}: choose from {', '.join(DEPLOYMENTS)}")
    for flag, value in (("--prompt-len", args.prompt_len), ("--max-tokens", args.max_tokens)):
        if value < 1:
            parser.error(f"{flag} is {value}; expected at least 1")
    if not args.timeout > 0:
        parser.error(f"--timeout is {args.timeout}; expected a positive number of seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    import shlex

    from pdserve.bench.machine import load_average, machine_info
    from pdserve.bench.serve_datasets import RandomSpec, random_requests
    from pdserve.bench.serve_report import json_safe
    from pdserve.bench.serve_vocab import load_vocabulary

    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    machine = machine_info()
    if args.model is None:
        from pdserve.model_store.default_model import ensure_default_model

        vocab = load_vocabulary(str(ensure_default_model()), None)
    else:
        vocab = load_vocabulary(args.model, None)
    spec = RandomSpec(args.prompt_len, args.max_tokens)
    prompts_by_burst = {
        size: [
            r.prompt for r in random_requests(spec, size, vocab.ids, f"burst-{size}-{args.seed}")
        ]
        for size in args.bursts
    }
    raise_open_file_limit(2 * max(args.bursts) + 1024)
    deployments = {
        run_label(name, loaded_host): run_deployment(
            name, args, prompts_by_burst, vocab.ids, loaded_host
        )
        for name in args.deployments
        for loaded_host in LOADED_HOST_RUNS[args.loaded_host]
    }
    floors = {}
    if args.client_floor == "yes":
        bodies_by_burst = {
            size: [completion_body("any", prompt, args.max_tokens) for prompt in prompts]
            for size, prompts in prompts_by_burst.items()
        }
        for loaded_host in LOADED_HOST_RUNS[args.loaded_host]:
            host = "loaded" if loaded_host else "idle"
            say(f"client floor ({host} host): the bursts against a server that refuses at once")
            floors[host] = run_client_floor(bodies_by_burst, args.timeout, loaded_host, SETTLE_S)
    machine["load average at end"] = load_average()
    setup = {
        "model": args.model or "SmolLM2-135M-Instruct (the default model)",
        "prompts": f"{args.prompt_len} random token ids from {vocab.source}, distinct per request",
        "output": f"{args.max_tokens} tokens, greedy, EOS ignored, streamed with usage",
        "per-request timeout": f"{args.timeout:g} s",
        "client": f"aiohttp, one {event_loop_name()} loop, one connection per stream",
        "warm-up": f"{WARMUP_REQUESTS} short requests per server, {SETTLE_S:g} s between "
        "bursts; bursts in the order given, against the same server",
        "extra server flags": " ".join(args.server_arg) or "none",
        "loaded host": {"no": "not run", "also": "each deployment idle, then loaded",
                        "only": "loaded runs only"}[args.loaded_host],
    }
    result = json_safe(
        {
            "command": shlex.join(["python", "-m", "pdserve.bench.burst", *raw]),
            "machine": machine,
            "setup": setup,
            "deployments": deployments,
            "client_floor": floors,
        }
    )
    write_report(args.out_dir, "burst", result, markdown(result))
    died = any(s["died"] for run in deployments.values() for s in run["bursts"].values())
    return 1 if died or any(run.get("error") for run in deployments.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
