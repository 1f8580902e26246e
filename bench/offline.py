"""Offline throughput of pdserve vs Hugging Face transformers, on one model, dtype and machine.

What it measures (all fp32, same thread count, greedy decoding, one process):

1. pdserve: ``LLM.generate`` on the whole workload at once (continuous batching, paged KV
   cache). Only the generate call is timed; engine construction and a tiny warm-up are not.
2. transformers ``generate()`` in left-padded static batches of ``--hf-batch-size`` requests
   (request order). Each batch runs to its longest ``max_tokens``; tokens past a request's own
   ``max_tokens`` are wasted work and are not counted.
3. transformers ``generate()`` one request at a time, on the first ``--hf-single-requests``
   requests only (it is slow); its rate is the measured one on those requests, nothing is
   extrapolated.

Workload: ``--num-requests`` requests with random token-id prompts (special tokens excluded);
prompt lengths uniform in [32, 512] and output lengths uniform in [16, 256], drawn from
``--seed``. Every request produces exactly its ``max_tokens`` (EOS is ignored), so "useful
output tokens" is the sum of the requests' ``max_tokens`` for every system.

Also measured: pdserve's batch-1 decode step time against the memory-bandwidth floor (weight
bytes a decode step streams / copy bandwidth measured in the same run, counted as bytes moved /
2; see ``bench/bandwidth.py``), the model's matmuls alone at batch 1, a torch.profiler
breakdown (engine phases and top ops by self CPU time) of one prefill step, batched decode
steps and batch-1 decode steps, and a parity check: pdserve's greedy tokens vs transformers'
batch-1 tokens on the requests that ran in (3).

The report is printed and written as markdown to ``--output``.

    python -m bench.offline                       # full default run (10-20 min on 2 cores)
    python -m bench.offline --num-requests 8 --hf-single-requests 2 --output /tmp/o.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python bench/offline.py` puts bench/ first, not the root
    sys.path.insert(0, str(REPO_ROOT))

GIB = 2**30
TARGET_VS_HF_BATCHED = 3.0
TARGET_VS_HF_SINGLE = 10.0
TARGET_FLOOR_FRACTION = 0.70


# --------------------------------------------------------------------------- data types


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class Throughput:
    """One system's run: useful tokens are the requests' own max_tokens, summed."""

    name: str
    num_requests: int
    useful_tokens: int
    computed_tokens: int  # generated tokens including static-batching waste
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


@dataclasses.dataclass(frozen=True)
class DecodeTiming:
    """Batch-1 decode: per-step wall times of engine.step() and of the model forward in it."""

    prompt_len: int
    step_s: list[float]
    forward_s: list[float]
    matmuls_s: float = 0.0  # the model's matmul layers alone, each called on a [1, in] input

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def median_forward_s(self) -> float:
        return statistics.median(self.forward_s)


@dataclasses.dataclass(frozen=True)
class OpRow:
    name: str
    self_ms_per_step: float
    share: float  # of all self CPU time in the profiled steps
    calls_per_step: float


@dataclasses.dataclass(frozen=True)
class ProfileSummary:
    title: str
    num_steps: int
    tokens_per_step: float
    wall_ms_per_step: float
    phases: list[tuple[str, float]]  # (label, CPU ms per step, children included)
    top_ops: list[OpRow]


# --------------------------------------------------------------------------- setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's current")
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX")
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--hf-single-requests", type=int, default=16, metavar="K")
    parser.add_argument("--decode-steps", type=int, default=128, help="batch-1 timed steps")
    parser.add_argument("--profile-steps", type=int, default=5, help="decode steps profiled")
    parser.add_argument("--top-ops", type=int, default=12)
    parser.add_argument("--skip-hf-batched", action="store_true")
    parser.add_argument("--skip-hf-single", action="store_true")
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/offline.md")
    return parser.parse_args(argv)


def command_line() -> str:
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = f"python -m {main_spec.name}" if main_spec else f"python {sys.argv[0]}"
    return " ".join([program, *sys.argv[1:]])


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, str]:
    import transformers

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cores": f"{cores} usable ({os.cpu_count()} online)",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads",
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load average at start": load_average(),
    }


def load_average() -> str:
    """1-minute load average: other processes on this small machine skew every number."""
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"


def resolve_model(model: str | None) -> Path:
    if model is not None:
        return Path(model)
    from engine.default_model import ensure_default_model

    return ensure_default_model()


def make_workload(
    tokenizer: Any,
    vocab_size: int,
    num_requests: int,
    seed: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
) -> list[Request]:
    """Random prompts over the non-special vocabulary, uniform lengths, all from `seed`."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    vocab = [t for t in range(min(vocab_size, len(tokenizer))) if t not in special]
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_len)
        prompt = [rng.choice(vocab) for _ in range(length)]
        requests.append(Request(prompt, rng.randint(*output_len)))
    return requests


# --------------------------------------------------------------------------- pdserve


def build_llm(model_path: Path, args: argparse.Namespace) -> Any:
    from engine import LLM

    return LLM(
        str(model_path),
        dtype="float32",
        num_threads=args.threads,
        kv_cache_memory=int(args.kv_cache_gib * GIB),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )


def greedy(max_tokens: int) -> Any:
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_pdserve(llm: Any, workload: list[Request]) -> tuple[Throughput, list[list[int]]]:
    llm.generate([r.prompt[:8] for r in workload[:4]], [greedy(4)] * min(4, len(workload)))
    params = [greedy(r.max_tokens) for r in workload]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in workload], params)
    seconds = time.perf_counter() - start
    tokens = [list(o.token_ids) for o in outputs]
    useful = sum(min(len(t), r.max_tokens) for t, r in zip(tokens, workload))
    computed = sum(len(t) for t in tokens)
    return Throughput("pdserve LLM.generate", len(workload), useful, computed, seconds), tokens


@contextmanager
def patched(obj: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Temporarily replaces obj.name with make(original) (instance or module attribute)."""
    original = getattr(obj, name)
    owned = not hasattr(obj, "__dict__") or name in vars(obj)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        if owned:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def timed(sink: list[float]) -> Callable[[Callable], Callable]:
    def make(fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sink.append(time.perf_counter() - start)

        return wrapper

    return make


def labelled(label: str) -> Callable[[Callable], Callable]:
    def make(fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        return wrapper

    return make


PHASES = ("pd.step", "pd.schedule", "pd.build_batch", "pd.attn_prepare", "pd.model", "pd.sample")


@contextmanager
def labelled_phases(engine: Any) -> Iterator[None]:
    """Wraps the engine's phases in profiler ranges: schedule, batch, metadata, model, sample."""
    from engine import model_runner

    runner = engine.runner
    with (
        patched(engine, "step", labelled("pd.step")),
        patched(engine.scheduler, "schedule", labelled("pd.schedule")),
        patched(model_runner, "build_flat_batch", labelled("pd.build_batch")),
        patched(runner.attention, "prepare", labelled("pd.attn_prepare")),
        patched(runner, "model", labelled("pd.model")),
        patched(runner, "sampler", labelled("pd.sample")),
    ):
        yield


def step_until(engine: Any, done: Callable[[], bool], limit: int = 10_000) -> None:
    for _ in range(limit):
        if done():
            return
        engine.step()
    raise RuntimeError("the engine did not reach the expected state")


def abort_all(engine: Any, request_ids: list[str]) -> None:
    for request_id in request_ids:
        engine.abort_request(request_id)


def measure_decode_b1(engine: Any, prompt: list[int], num_steps: int) -> DecodeTiming:
    """Times engine.step() (and the model forward inside it) for one decoding request."""
    engine.add_request("bench-b1", prompt, greedy(num_steps + 2))
    engine.step()  # prefill, not timed
    step_s: list[float] = []
    forward_s: list[float] = []
    with patched(engine.runner, "model", timed(forward_s)):
        for _ in range(num_steps):
            start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
    abort_all(engine, ["bench-b1"])
    return DecodeTiming(len(prompt), step_s, forward_s)


def matmul_calls(model: torch.nn.Module) -> list[Callable[[], torch.Tensor]]:
    """One batch-1 call per matmul layer of the model (leaf modules with a 2-D `weight` [out,
    in] or `weight_t` [in, out], embeddings excluded), plus the output head when it is the
    tied embedding used through `lm_head_weight` rather than a module of its own."""
    calls: list[Callable[[], torch.Tensor]] = []
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) or next(module.children(), None) is not None:
            continue
        weight_t, weight = getattr(module, "weight_t", None), getattr(module, "weight", None)
        if isinstance(weight_t, torch.Tensor) and weight_t.dim() == 2:
            in_features = weight_t.shape[0]
        elif isinstance(weight, torch.Tensor) and weight.dim() == 2:
            in_features = weight.shape[1]
        else:
            continue
        x = torch.randn(1, in_features)
        calls.append(lambda module=module, x=x: module(x))
    head = getattr(model, "lm_head_weight", None)
    if head is not None and any(head.data_ptr() == m.weight.data_ptr() for m in _embeddings(model)):
        x_head = torch.randn(1, head.shape[1])
        calls.append(lambda: F.linear(x_head, head))
    return calls


def _embeddings(model: torch.nn.Module) -> list[torch.nn.Embedding]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]


@torch.inference_mode()
def time_matmuls_b1(model: torch.nn.Module) -> float:
    """Batch-1 time of the model's matmul layers alone (best of 5): the kernel part of a
    decode step, without attention, norms, activations or Python glue between them."""
    from bench.bandwidth import best_time

    calls = matmul_calls(model)
    return best_time(lambda: [call() for call in calls], 5)


def best_bandwidth(first: Any, second: Any) -> Any:
    """Per measurement, the better of two runs (this machine's bandwidth drifts over time)."""
    return dataclasses.replace(
        first,
        copy_read=max(first.copy_read, second.copy_read),
        sum_read=max(first.sum_read, second.sum_read),
        gemv_read=max(first.gemv_read, second.gemv_read),
    )


def decode_weight_bytes(model: torch.nn.Module, vocab_size: int) -> int:
    """Bytes of weights one decode step streams: every distinct parameter except embedding
    tables (a decode gathers a few rows), plus the embedding once if it is also the output head
    (tied, and no other [vocab, hidden] matrix exists)."""
    embedding_ptrs = {m.weight.data_ptr(): m.weight for m in _embeddings(model)}
    seen: set[int] = set()
    total, has_head = 0, False
    for param in model.parameters():
        if param.data_ptr() in seen or param.data_ptr() in embedding_ptrs:
            continue
        seen.add(param.data_ptr())
        total += param.numel() * param.element_size()
        has_head |= param.dim() == 2 and vocab_size in param.shape
    if not has_head:
        total += sum(w.numel() * w.element_size() for w in embedding_ptrs.values())
    return total


def unique_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of all distinct parameters (shared storage counted once)."""
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(unique.values())


# --------------------------------------------------------------------------- profiling


def profile_steps(engine: Any, title: str, num_steps: int, top: int) -> ProfileSummary:
    """Profiles `num_steps` engine steps (CPU activities) and summarizes phases and ops."""
    from torch.profiler import ProfilerActivity, profile

    tokens: list[int] = []
    counting = patched(engine.scheduler, "schedule", counted(tokens))
    with counting, labelled_phases(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = time.perf_counter() - start
    return summarize_profile(prof, title, num_steps, sum(tokens), wall, top)


def counted(sink: list[int]) -> Callable[[Callable], Callable]:
    """Wraps Scheduler.schedule to record each step's number of batched tokens."""

    def make(schedule: Callable) -> Callable:
        def wrapper() -> Any:
            out = schedule()
            sink.append(out.num_batched_tokens)
            return out

        return wrapper

    return make


def summarize_profile(
    prof: Any, title: str, num_steps: int, tokens: int, wall: float, top: int
) -> ProfileSummary:
    events = list(prof.key_averages())
    total_self = sum(e.self_cpu_time_total for e in events) or 1.0
    by_key = {e.key: e for e in events}
    phases = [
        (label, by_key[label].cpu_time_total / 1e3 / num_steps)
        for label in PHASES
        if label in by_key
    ]
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    rows = [
        OpRow(
            name=e.key,
            self_ms_per_step=e.self_cpu_time_total / 1e3 / num_steps,
            share=e.self_cpu_time_total / total_self,
            calls_per_step=e.count / num_steps,
        )
        for e in ranked
    ]
    return ProfileSummary(
        title, num_steps, tokens / num_steps, wall * 1e3 / num_steps, phases, rows
    )


def profile_prefill(engine: Any, workload: list[Request], budget: int, top: int) -> ProfileSummary:
    """One step of fresh prompts filling the token budget (pure prefill)."""
    ids, total = [], 0
    for i, request in enumerate(workload):
        if total >= budget:
            break
        engine.add_request(f"prof-p{i}", request.prompt, greedy(1))
        ids.append(f"prof-p{i}")
        total += len(request.prompt)
    summary = profile_steps(engine, "prefill step", 1, top)
    abort_all(engine, ids)
    return summary


def profile_decode(engine: Any, workload: list[Request], steps: int, top: int) -> ProfileSummary:
    """`steps` pure-decode steps with every workload request running."""
    ids = [f"prof-d{i}" for i in range(len(workload))]
    for request_id, request in zip(ids, workload):
        engine.add_request(request_id, request.prompt, greedy(steps + len(workload) + 64))
    scheduler = engine.scheduler
    step_until(
        engine,
        lambda: (
            not scheduler.waiting and all(s.num_uncomputed_tokens == 1 for s in scheduler.running)
        ),
    )
    title = f"decode steps, batch {len(scheduler.running)}"
    summary = profile_steps(engine, title, steps, top)
    abort_all(engine, ids)
    return summary


def profile_decode_b1(engine: Any, prompt: list[int], steps: int, top: int) -> ProfileSummary:
    engine.add_request("prof-b1", prompt, greedy(steps + 2))
    engine.step()
    summary = profile_steps(engine, "decode steps, batch 1", steps, top)
    abort_all(engine, ["prof-b1"])
    return summary


# --------------------------------------------------------------------------- transformers


def load_hf_model(model_path: Path) -> Any:
    """The same checkpoint through transformers, with EOS disabled (no early stops)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad if isinstance(pad, int) else next(iter(pad))
    return model


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


@torch.inference_mode()
def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy generate of exactly `new_tokens` tokens for each (left-padded) prompt."""
    ids, mask = left_pad(prompts, model.generation_config.pad_token_id)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )
    generated = out[:, ids.shape[1] :]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"transformers generated {generated.shape[1]} != {new_tokens} tokens")
    return generated.tolist()


def run_hf_batched(model: Any, workload: list[Request], batch_size: int) -> Throughput:
    hf_generate(model, [workload[0].prompt[:8]] * 2, 4)  # warm-up
    useful = computed = 0
    start = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first : first + batch_size]
        longest = max(r.max_tokens for r in batch)
        hf_generate(model, [r.prompt for r in batch], longest)
        useful += sum(r.max_tokens for r in batch)
        computed += longest * len(batch)
    seconds = time.perf_counter() - start
    name = f"transformers static batch {batch_size}"
    return Throughput(name, len(workload), useful, computed, seconds)


def run_hf_single(model: Any, workload: list[Request]) -> tuple[Throughput, list[list[int]]]:
    hf_generate(model, [workload[0].prompt[:8]], 4)  # warm-up
    tokens = []
    start = time.perf_counter()
    for request in workload:
        tokens.append(hf_generate(model, [request.prompt], request.max_tokens)[0])
    seconds = time.perf_counter() - start
    useful = sum(r.max_tokens for r in workload)
    name = f"transformers batch 1 (first {len(workload)} requests)"
    return Throughput(name, len(workload), useful, useful, seconds), tokens


def first_differences(
    pdserve_tokens: list[list[int]], hf_tokens: list[list[int]]
) -> list[int | None]:
    """Per request (zip order): the index of the first differing token, None if identical."""
    diffs: list[int | None] = []
    for ours, theirs in zip(pdserve_tokens, hf_tokens):
        if ours == theirs:
            diffs.append(None)
            continue
        first = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        diffs.append(min(len(ours), len(theirs)) if first is None else first)
    return diffs


def parity_lines(diffs: list[int | None], workload: list[Request]) -> list[str]:
    """The summary line "parity: N/M requests identical", then one line per mismatch."""
    same = sum(d is None for d in diffs)
    lines = [f"parity: {same}/{len(diffs)} requests identical"]
    lines += [
        f"request {i}: first difference at token {d} of {workload[i].max_tokens}"
        for i, d in enumerate(diffs)
        if d is not None
    ]
    return lines


# --------------------------------------------------------------------------- report


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def throughput_section(runs: list[Throughput]) -> str:
    rows = [
        [
            run.name,
            str(run.num_requests),
            f"{run.useful_tokens:,}",
            f"{run.computed_tokens:,}",
            f"{run.seconds:.1f}",
            f"**{run.tokens_per_s:.1f}**",
        ]
        for run in runs
    ]
    header = ["system", "requests", "useful tokens", "computed tokens", "time (s)", "useful tok/s"]
    return md_table(header, rows)


def ratio_section(runs: list[Throughput]) -> str:
    ours, others = runs[0], runs[1:]
    targets = {"static batch": TARGET_VS_HF_BATCHED, "batch 1": TARGET_VS_HF_SINGLE}
    rows = []
    for other in others:
        target = next(t for key, t in targets.items() if key in other.name)
        ratio = ours.tokens_per_s / other.tokens_per_s
        verdict = "met" if ratio >= target else "NOT met"
        rows.append([f"pdserve / {other.name}", f"**{ratio:.2f}x**", f">= {target:g}x", verdict])
    return md_table(["ratio", "value", "target", ""], rows)


def decode_section(timing: DecodeTiming, weight_bytes: int, bandwidth: Any) -> str:
    """Floor = weight bytes / copy bandwidth (bytes of src / time = bytes moved / 2)."""
    floor_s = weight_bytes / bandwidth.copy_read
    read_floor_s = weight_bytes / bandwidth.best_read
    step, forward = timing.median_step_s, timing.median_forward_s
    fraction = floor_s / step
    verdict = "met" if fraction >= TARGET_FLOOR_FRACTION else "NOT met"
    ms = 1e3
    rows = [
        ["weight bytes read per step", f"{weight_bytes / 1e6:.1f} MB"],
        ["copy bandwidth (bytes of src / time = bytes moved / 2) *", _gbs(bandwidth.copy_read)],
        [
            "streaming-read bandwidth (`sum`) / 512 MiB GEMV (`mv`) *",
            f"{_gbs(bandwidth.sum_read)} / {_gbs(bandwidth.gemv_read)}",
        ],
        ["**floor** = weight bytes / copy bandwidth", f"**{floor_s * ms:.1f} ms**"],
        ["stricter floor = weight bytes / best pure-read bandwidth", f"{read_floor_s * ms:.1f} ms"],
        [
            f"pdserve engine.step(), batch 1 (median of {len(timing.step_s)})",
            (
                f"**{step * ms:.1f} ms** (mean {statistics.mean(timing.step_s) * ms:.1f}, "
                f"min {min(timing.step_s) * ms:.1f})"
            ),
        ],
        ["  of which model forward (median)", f"{forward * ms:.1f} ms"],
        ["  engine overhead outside the forward", f"{(step - forward) * ms:.1f} ms"],
        [
            "  the model's matmul layers alone, back to back (best of 5)",
            f"{timing.matmuls_s * ms:.1f} ms ({_gbs(weight_bytes / timing.matmuls_s)})",
        ],
        [
            "  forward time outside the matmuls (attention, norms, rope, Python glue)",
            f"{(forward - timing.matmuls_s) * ms:.1f} ms",
        ],
        [
            "**achieved fraction** = floor / step time",
            (
                f"**{fraction:.0%}** (target >= {TARGET_FLOOR_FRACTION:.0%}: {verdict}); "
                f"vs stricter floor: {read_floor_s / step:.0%}"
            ),
        ],
    ]
    note = (
        "\n\n\\* 512 MiB fp32 buffers, best of 5, measured twice (start of the run and just "
        "before the batch-1 timing); the better of the two is shown."
    )
    return md_table(["batch-1 decode", "value"], rows) + note


def _gbs(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.1f} GB/s"


def profile_section(summary: ProfileSummary) -> str:
    phase_rows = [[label, f"{ms:.2f}"] for label, ms in summary.phases]
    op_rows = [
        [
            f"`{row.name}`",
            f"{row.self_ms_per_step:.2f}",
            f"{row.share:.1%}",
            f"{row.calls_per_step:g}",
        ]
        for row in summary.top_ops
    ]
    head = (
        f"#### {summary.title}\n\n{summary.num_steps} step(s), {summary.tokens_per_step:.0f} "
        f"tokens/step, {summary.wall_ms_per_step:.1f} ms/step wall under the profiler.\n\n"
    )
    phases = md_table(["phase (children included)", "CPU ms/step"], phase_rows)
    ops = md_table(["op (self CPU)", "ms/step", "share", "calls/step"], op_rows)
    return head + phases + "\n\n" + ops


def parity_section(lines: list[str]) -> str:
    summary = lines[0].removeprefix("parity: ")
    head = f"Parity of greedy tokens, pdserve vs transformers batch 1: {summary}"
    return "\n".join([head, *(f"- {line}" for line in lines[1:])]) + "\n"


def setup_paragraph(results: dict[str, Any], args: argparse.Namespace) -> str:
    return (
        f"Model: `{results['model']}` ({results['param_bytes'] / 1e6:.0f} MB of fp32 "
        f"parameters, {results['weight_bytes'] / 1e6:.0f} MB of them read per decode step). "
        f"Workload: {args.num_requests} requests, seed {args.seed}, prompts "
        f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens ({results['prompt_tokens']:,} in all),"
        f" outputs {args.output_len[0]}-{args.output_len[1]} tokens, greedy, EOS ignored. "
        f"pdserve: max_num_batched_tokens {args.max_num_batched_tokens}, max_num_seqs "
        f"{args.max_num_seqs}, KV cache {args.kv_cache_gib:g} GiB, "
        f"{results['preemptions']} preemptions.\n"
    )


def build_report(results: dict[str, Any], args: argparse.Namespace) -> str:
    parts = [
        "# Offline throughput: pdserve vs transformers\n",
        f"Command: `{results['command']}`\n",
        md_table(["machine", ""], [[k, v] for k, v in results["machine"].items()]),
        "",
        setup_paragraph(results, args),
        "## Throughput (useful output tokens/s)\n",
        throughput_section(results["runs"]),
        "",
        ratio_section(results["runs"]) if len(results["runs"]) > 1 else "",
        "",
        parity_section(results["parity"]),
        "## Batch-1 decode vs the memory-bandwidth floor\n",
        decode_section(results["decode"], results["weight_bytes"], results["bandwidth"]),
        "",
    ]
    if results["profiles"]:
        parts.append("## Where pdserve's time goes (torch.profiler, CPU)\n")
        parts.append(
            "Phases are profiler ranges around the engine's parts (children included); "
            "`pd.*` rows in the op tables are the Python time of that phase outside any "
            "aten op. Profiler overhead inflates per-op Python time.\n"
        )
        parts += [profile_section(s) + "\n" for s in results["profiles"]]
    return "\n".join(parts).rstrip() + "\n"


# --------------------------------------------------------------------------- main


def say(message: str) -> None:
    print(f"[offline {time.strftime('%H:%M:%S')}] {message}", flush=True)


def bench_pdserve(
    args: argparse.Namespace, model_path: Path, results: dict[str, Any]
) -> tuple[list[Request], list[list[int]]]:
    """pdserve's part: throughput, batch-1 decode vs the floor, profiles. Fills `results`."""
    from bench.bandwidth import measure_bandwidth
    from engine.tokenizer import load_tokenizer

    say("loading pdserve")
    llm = build_llm(model_path, args)
    engine = llm.engine
    workload = make_workload(
        load_tokenizer(model_path),
        engine.model_config.vocab_size,
        args.num_requests,
        args.seed,
        tuple(args.prompt_len),
        tuple(args.output_len),
    )
    results["prompt_tokens"] = sum(len(r.prompt) for r in workload)
    results["param_bytes"] = unique_param_bytes(engine.runner.model)
    results["weight_bytes"] = decode_weight_bytes(
        engine.runner.model, engine.model_config.vocab_size
    )

    say(f"pdserve: generating {sum(r.max_tokens for r in workload):,} tokens")
    run, tokens = run_pdserve(llm, workload)
    results["runs"] = [run]
    results["preemptions"] = engine.scheduler.num_preemptions
    say(f"pdserve: {run.tokens_per_s:.1f} useful tok/s in {run.seconds:.1f} s")

    say("measuring memory bandwidth again, next to the batch-1 timing")
    results["bandwidth"] = best_bandwidth(results["bandwidth"], measure_bandwidth())
    say(f"pdserve: timing {args.decode_steps} batch-1 decode steps")
    b1_prompt = workload[0].prompt[:32]
    timing = measure_decode_b1(engine, b1_prompt, args.decode_steps)
    matmuls = time_matmuls_b1(engine.runner.model)
    results["decode"] = dataclasses.replace(timing, matmuls_s=matmuls)
    say(f"pdserve: batch-1 step {timing.median_step_s * 1e3:.1f} ms (median)")

    results["profiles"] = []
    if not args.skip_profile:
        say("profiling pdserve")
        results["profiles"] = [
            profile_prefill(engine, workload, args.max_num_batched_tokens, args.top_ops),
            profile_decode(engine, workload, args.profile_steps, args.top_ops),
            profile_decode_b1(engine, b1_prompt, 2 * args.profile_steps, args.top_ops),
        ]
    return workload, tokens


def bench_transformers(
    args: argparse.Namespace,
    model_path: Path,
    workload: list[Request],
    pdserve_tokens: list[list[int]],
    results: dict[str, Any],
) -> None:
    """transformers' part: static batches, batch 1 on the first K requests, parity."""
    results["parity"] = ["not checked (--skip-hf-single)"]
    if args.skip_hf_batched and args.skip_hf_single:
        return
    say("loading transformers")
    model = load_hf_model(model_path)
    if not args.skip_hf_batched:
        say(f"transformers: static batches of {args.hf_batch_size}")
        results["runs"].append(run_hf_batched(model, workload, args.hf_batch_size))
        say(f"transformers batched: {results['runs'][-1].tokens_per_s:.1f} useful tok/s")
    if not args.skip_hf_single:
        single = workload[: args.hf_single_requests]
        say(f"transformers: batch 1 on the first {len(single)} requests")
        run, hf_tokens = run_hf_single(model, single)
        results["runs"].append(run)
        say(f"transformers batch 1: {run.tokens_per_s:.1f} useful tok/s")
        results["parity"] = parity_lines(first_differences(pdserve_tokens, hf_tokens), workload)
        print("\n".join(results["parity"]), flush=True)


def main(argv: list[str] | None = None) -> None:
    from bench.bandwidth import measure_bandwidth

    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    torch.manual_seed(args.seed)
    results: dict[str, Any] = {"command": command_line(), "machine": machine_info()}
    model_path = resolve_model(args.model)
    results["model"] = str(model_path)
    say(f"command: {results['command']}")
    say(f"machine: {results['machine']}")

    say("measuring memory bandwidth")
    results["bandwidth"] = measure_bandwidth()
    workload, pdserve_tokens = bench_pdserve(args, model_path, results)
    bench_transformers(args, model_path, workload, pdserve_tokens, results)
    results["machine"]["load average at end"] = load_average()

    report = build_report(results, args)
    print("\n" + report, flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report, encoding="utf-8")
    say(f"report written to {args.output}")


if __name__ == "__main__":
    main()
