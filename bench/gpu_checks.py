"""The checks of `make gpu-check` that run inside a child process of bench/gpu_check.py, one
per process: `python -m pdserve.bench.gpu_checks NAME SCRATCH` runs check NAME and writes
SCRATCH/NAME.json ({"ok", "detail", "numbers"}), which the driver reads for its report. The
driver's environment makes pdserve and the checkout's tests importable (gpu_check.checkout_env).

  gpu         the device, its shared memory per block, the attention tiles chosen for it at
              head dim 128, and the copy bandwidth (bytes read + written per second)
  cuda-ipc    a decode and a prefill peer process (kvtransfer.peer), each with the
              CUDA_VISIBLE_DEVICES pdserve's launcher gives a 1P1D cuda_ipc deployment on this
              host, move shuffled blocks bit-exact: a small fp32 cache, and 512 MiB of a
              Llama-3-8B-shaped bf16 cache, timed from write to commit
  serve-1p1d  `pdserve serve` 1P1D (cuda_ipc on the one GPU) then `--colocated`, a tiny Llama,
              the same concurrent greedy requests over HTTP: equal text and token counts
  llama8b     an engine over a folder holding only Llama-3-8B's config.json
              (load_format="dummy", bf16, CUDA graphs as on by default): `engine.step()` at
              batch 1/32/256 after every prompt (512 tokens) is in, against the floor
              weight bytes / copy bandwidth (and weights + KV read / copy bandwidth)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

LLAMA_BATCHES = (1, 32, 256)
LLAMA_CONTEXT = 512
LLAMA_TIMED_STEPS = 10
SERVE_READY_TIMEOUT_S = 25  # each deployment; both run inside the step's limit
GIB = 2**30
CheckResult = tuple[bool, str, dict]  # (passed, one line for the summary, numbers)


def run_check(name: str, scratch: Path) -> int:
    """Runs check `name`; whatever it raises becomes a failed result with the reason."""
    try:
        ok, detail, numbers = CHECKS[name](scratch)
    except Exception as error:  # noqa: BLE001 (reported as the step's result)
        import traceback

        traceback.print_exc()
        ok, detail, numbers = False, f"{type(error).__name__}: {error}"[:400], {}
    result = {"ok": ok, "detail": detail, "numbers": numbers}
    (scratch / f"{name}.json").write_text(json.dumps(result), encoding="utf-8")
    return 0 if ok else 1


def check_gpu(scratch: Path) -> CheckResult:
    import torch
    import triton

    from pdserve.bench.kernels import copy_bandwidth
    from pdserve.kernels.tiles import device_shared_memory, tile_config

    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA device", {}
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    shared = device_shared_memory(device)
    tiles = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        config = tile_config(dtype, 128, shared)
        tiles[str(dtype).removeprefix("torch.")] = (
            f"prefill {config.prefill.block_m}x{config.prefill.block_n} "
            f"({config.prefill.num_stages} stages), decode tile {config.decode.tile}"
        )
    bandwidth = copy_bandwidth(device, 4.0)
    numbers = {
        "gpu": f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / GIB:.0f} GiB, "
        f"{props.multi_processor_count} SMs",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "shared memory per block (opt-in)": f"{shared:,} bytes",
        "attention tiles at head dim 128": tiles,
        "copy bandwidth (read + written)": f"{bandwidth / 1e9:,.0f} GB/s",
    }
    print(json.dumps(numbers, indent=1))
    return True, f"{props.name}, copy {bandwidth / 1e9:,.0f} GB/s", numbers


def launcher_visible_devices(num_nodes: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each node of a cuda_ipc deployment of `num_nodes` processes on
    this host, as pdserve's launcher computes it."""
    import torch

    try:
        from pdserve.commands.launcher import launcher_gpus, place_on_gpus
    except ImportError:  # a launcher that numbers devices itself: one GPU, index 0 for all
        return ["0"] * num_nodes
    gpus = launcher_gpus(os.environ, torch.cuda.device_count())
    return [",".join(p.visible_devices) for p in place_on_gpus(num_nodes, gpus, True)]


def check_cuda_ipc(scratch: Path) -> CheckResult:
    import random

    from pdserve.kvtransfer.peer import PeerProcess

    prefill_devices, decode_devices = launcher_visible_devices(2)
    peers = {}
    for role, devices in (("decode", decode_devices), ("prefill", prefill_devices)):
        os.environ["CUDA_VISIBLE_DEVICES"] = devices  # the child inherits it
        peers[role] = PeerProcess(scratch / f"ipc-{role}.log")
    decode, prefill = peers["decode"], peers["prefill"]
    numbers = {"CUDA_VISIBLE_DEVICES": f"prefill {prefill_devices!r}, decode {decode_devices!r}"}
    try:
        for peer in peers.values():
            peer.wait_started(90)
        cases = [  # (name, spec, blocks, blocks moved, step bytes)
            ("fp32-small", {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64,
                            "block_size": 16, "dtype": "float32"}, 64, 24, 1 << 16),
            ("bf16-llama8b", {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
                              "block_size": 16, "dtype": "bfloat16"}, 320, 256, 64 << 20),
        ]
        for name, spec, num_blocks, moved, step_bytes in cases:
            rng = random.Random(num_blocks)
            src = rng.sample(range(num_blocks), moved)
            dst = rng.sample(range(num_blocks), moved)
            descriptor = decode.call(
                "open_receiver", name=name, transport="cuda_ipc", node_id=f"ipc-{name}",
                num_blocks=num_blocks, device="cuda", spec=spec, timeout=60,
            )["descriptor"]
            prefill.call(
                "open_sender", name=name, transport="cuda_ipc", descriptor=descriptor, seed=3,
                num_blocks=num_blocks, device="cuda", step_bytes=step_bytes,
                window=2 * step_bytes, timeout=60,
            )
            decode.call("expect", name=name, transfer_id=name, block_ids=dst, deadline_s=60)
            started = time.perf_counter()
            prefill.call("write", name=name, transfer_id=name, src=src, dst=dst)
            kind = prefill.call("wait", name=name, transfer_id=name, wait_s=60, timeout=70)["kind"]
            seconds = time.perf_counter() - started
            if kind != "complete":
                return False, f"{name}: the transfer ended {kind}", numbers
            if decode.call("wait", name=name, transfer_id=name, wait_s=60, timeout=70)[
                "kind"
            ] != "complete":
                return False, f"{name}: the decode side did not commit", numbers
            sent = prefill.call("hashes", name=name, block_ids=src, timeout=60)["hashes"]
            arrived = decode.call("hashes", name=name, block_ids=dst, timeout=60)["hashes"]
            if sent != arrived:
                wrong = sum(a != b for a, b in zip(sent, arrived))
                return False, f"{name}: {wrong} of {moved} blocks differ", numbers
            block_bytes = 2 * spec["num_layers"] * spec["num_kv_heads"] * spec["head_dim"] * (
                spec["block_size"] * (4 if spec["dtype"] == "float32" else 2)
            )
            numbers[name] = (
                f"{moved} shuffled blocks ({moved * block_bytes / 2**20:,.0f} MiB) bit-exact, "
                f"write to commit {seconds * 1e3:,.1f} ms "
                f"({moved * block_bytes / seconds / 1e9:,.1f} GB/s)"
            )
            print(name, numbers[name], flush=True)
            prefill.call("close", name=name)
            decode.call("close", name=name)
    finally:
        for peer in peers.values():
            peer.stop()
    return True, numbers["bf16-llama8b"], numbers


def serve_flags(python: str) -> list[str]:
    """Flags for both deployments; those the CLI does not have yet are left out."""
    help_text = subprocess.run(
        [python, "-m", "pdserve.commands.cli", "serve", "--help"], capture_output=True, text=True,
        cwd=REPO_ROOT, check=False,
    ).stdout
    flags = ["--max-num-batched-tokens", "64", "--kv-cache-memory", str(64 << 20),
             "--attention-backend", "triton"]
    if "--dtype" in help_text:  # tiny models are compared in fp32 where serve can say so
        flags += ["--dtype", "float32"]
    return flags


def serve_requests(count: int = 24) -> list[dict]:
    import random

    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    bodies = []
    for i in range(count):
        head = shared if i % 2 else []
        prompt = head + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 120))]
        bodies.append({"prompt": prompt, "max_tokens": rng.randrange(4, 24), "temperature": 0,
                       "ignore_eos": True})
    return bodies


def complete_all(url: str, bodies: list[dict]) -> list[tuple[str, int]]:
    import asyncio

    import httpx

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]

            async def one(body):
                response = await http.post("/v1/completions", json={**body, "model": model})
                response.raise_for_status()
                data = response.json()
                return data["choices"][0]["text"], data["usage"]["completion_tokens"]

            return await asyncio.gather(*(one(b) for b in bodies))

    return list(asyncio.run(main()))


def check_serve_1p1d(scratch: Path) -> CheckResult:
    from pdserve.commands.serve_process import ServeProcess
    from pdserve.testing.tiny_models import save_tiny_model

    model_dir = save_tiny_model("llama", scratch / "tiny-llama")
    flags = ["--model", str(model_dir), *serve_flags(sys.executable)]
    bodies = serve_requests()
    numbers: dict = {"flags": " ".join(flags[2:]), "requests": len(bodies)}
    texts = {}
    for layout, extra in (("1p1d", []), ("colocated", ["--colocated"])):
        log_path = scratch / f"serve-{layout}.log"
        started = time.perf_counter()
        try:
            server = ServeProcess(
                [*flags, *extra], ready_timeout_s=SERVE_READY_TIMEOUT_S, log_path=log_path
            )
        except RuntimeError as error:
            print(log_path.read_text()[-4000:], flush=True)
            return False, f"{layout} did not start: {error}", numbers
        ready = time.perf_counter() - started
        try:
            begun = time.perf_counter()
            texts[layout] = complete_all(server.url, bodies)
            numbers[f"{layout} start (s)"] = round(ready, 1)
            numbers[f"{layout} {len(bodies)} requests (s)"] = round(time.perf_counter() - begun, 2)
        finally:
            server.close()
        if layout == "1p1d":
            print(log_path.read_text()[-3000:], flush=True)
    same = sum(a == b for a, b in zip(texts["1p1d"], texts["colocated"]))
    numbers["same text and token count"] = f"{same} of {len(bodies)}"
    differing = [i for i, pair in enumerate(zip(texts["1p1d"], texts["colocated"])) if
                 pair[0] != pair[1]]
    if differing:
        first = differing[0]
        numbers["first difference"] = (
            f"request {first}: 1P1D {texts['1p1d'][first]!r:.120} vs colocated "
            f"{texts['colocated'][first]!r:.120}"
        )
    tokens = sum(n for _, n in texts["1p1d"])
    detail = f"{same}/{len(bodies)} requests equal ({tokens} tokens)"
    return same == len(bodies), detail, numbers


def config_only_folder(folder: Path, config: dict) -> Path:
    """A model folder holding a Llama config.json and nothing else."""
    from transformers import LlamaConfig

    LlamaConfig(architectures=["LlamaForCausalLM"], **config).save_pretrained(folder)
    for extra in folder.iterdir():
        if extra.name != "config.json":
            extra.unlink()
    return folder


def dummy_engine(folder: Path, device: str, dtype: str, max_batch: int, max_model_len: int):
    """An engine with random weights (load_format "dummy") and KV for `max_batch` sequences
    of `max_model_len` tokens; no prefix cache, no swap, so every step does the same work."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    block_size = 16
    return LLMEngine(EngineConfig(
        model=str(folder), load_format="dummy", dtype=dtype, device=device,
        block_size=block_size, max_num_seqs=max_batch, max_num_batched_tokens=8192,
        max_model_len=max_model_len, num_kv_blocks=max_batch * -(-max_model_len // block_size),
        enable_prefix_caching=False, preemption_mode="recompute", swap_space=0,
    ))


def time_decode_steps(
    engine, batch: int, prompt_len: int, max_tokens: int, timed_steps: int, seed: int = 0
) -> tuple[float, float]:
    """(median seconds of `engine.step()` with `batch` sequences all decoding, their mean
    length then): the prompts go in first, untimed, then 3 warm-up steps, then `timed_steps`
    timed ones, synchronised with the device; the requests are aborted afterwards."""
    import torch

    from pdserve.wire.sampling_params import SamplingParams

    cuda = engine.runner.device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    ids = [f"b{batch}-{i}" for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    for request_id in ids:
        engine.add_request(
            request_id, torch.randint(3, vocab, (prompt_len,), generator=generator).tolist(), params
        )
    for _ in range(1000):
        if all(engine.sequences[r].num_output_tokens >= 1 for r in ids):
            break
        engine.step()
    for _ in range(3):
        engine.step()
    seconds = []
    for _ in range(timed_steps):
        synchronize()
        begun = time.perf_counter()
        engine.step()
        synchronize()
        seconds.append(time.perf_counter() - begun)
    length = statistics.mean(engine.sequences[r].num_tokens for r in ids)
    for request_id in ids:
        engine.abort_request(request_id)
    return statistics.median(seconds), length


def check_llama8b(scratch: Path) -> CheckResult:
    import torch

    from pdserve.bench.kernels import LLAMA_3_8B, copy_bandwidth

    bandwidth = copy_bandwidth(torch.device("cuda"), 4.0)
    torch.cuda.empty_cache()
    folder = config_only_folder(scratch / "llama-3-8b-config", LLAMA_3_8B)
    max_tokens = 96
    started = time.perf_counter()
    engine = dummy_engine(
        folder, "cuda", "bfloat16", max(LLAMA_BATCHES), LLAMA_CONTEXT + max_tokens
    )
    init_s = time.perf_counter() - started
    weight_bytes = engine.runner.model.decode_weight_bytes()
    spec = engine.runner.kv_cache.spec
    kv_bytes_per_token = spec.bytes_per_block // spec.block_size
    print(f"engine ready in {init_s:.1f} s; weights {weight_bytes / 1e9:.2f} GB; "
          f"CUDA graphs {engine.runner.decode_graphs is not None}", flush=True)
    runs = []
    for batch in LLAMA_BATCHES:
        step_s, length = time_decode_steps(
            engine, batch, LLAMA_CONTEXT, max_tokens, LLAMA_TIMED_STEPS
        )
        kv_bytes = int(batch * length * kv_bytes_per_token)
        runs.append({
            "batch": batch, "step_ms": step_s * 1e3, "kv_bytes": kv_bytes,
            "floor_weights_ms": weight_bytes / bandwidth * 1e3,
            "floor_all_ms": (weight_bytes + kv_bytes) / bandwidth * 1e3,
        })
        print(f"batch {batch}: {step_s * 1e3:.2f} ms/step, floor (weights) "
              f"{weight_bytes / bandwidth * 1e3:.2f} ms", flush=True)
    numbers = {
        "context": LLAMA_CONTEXT, "weight_bytes": weight_bytes, "copy_bandwidth": bandwidth,
        "engine_init_s": round(init_s, 1), "cuda_graphs": engine.runner.decode_graphs is not None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / GIB, 1), "runs": runs,
    }
    summary = ", ".join(
        f"b{r['batch']} {r['step_ms']:.2f} ms ({r['floor_weights_ms'] / r['step_ms']:.0%} of floor)"
        for r in runs
    )
    return True, summary, numbers


CHECKS = {
    "gpu": check_gpu,
    "cuda-ipc": check_cuda_ipc,
    "serve-1p1d": check_serve_1p1d,
    "llama8b": check_llama8b,
}

if __name__ == "__main__":
    sys.exit(run_check(sys.argv[1], Path(sys.argv[2])))
