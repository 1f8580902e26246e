"""`make gpu-check`: one prepared run that proves pdserve's GPU path on one NVIDIA GPU, sized for
an H200: at most 7 minutes (the steps' limits add up to TOTAL_BUDGET_S), with no network.

Each step runs as a child process with its own time limit, inside one total budget, so a step
that hangs or fails costs its own slot and the rest still run (in this order; gpu, cuda-ipc,
serve-1p1d and llama8b are the checks of bench/gpu_checks.py):

  wheels         installs what the machine lacks (pyzmq, fastapi, uvicorn, pydantic, llguidance
                 and their needs) offline from .gpu-wheels (`make gpu-wheels`) into a folder put
                 on PYTHONPATH; the machine's own torch and triton stay the ones used
  gpu            the device, its shared memory per block, the attention tiles chosen for it,
                 and the copy bandwidth (bytes read + written per second, 4 GiB device copy)
  kernels        the Triton kernel tests compiled (TRITON_INTERPRET=0) in fp32/fp16/bf16, and
                 over an fp8 (e4m3) KV cache with its scales
  parity         CUDA tests: greedy tokens equal to transformers' on tiny models (fp32), CUDA
                 graphs on and off, batched block copies, KV transports on the GPU
  cuda-ipc       two processes on the one GPU with the CUDA_VISIBLE_DEVICES the launcher gives
                 a 1P1D deployment: KV bit-exact over cuda_ipc, and its bandwidth
  serve-1p1d     `pdserve serve` 1P1D and `--colocated` on the one GPU serving a tiny model:
                 the same greedy text for the same concurrent requests over HTTP
  llama8b        a Llama-3-8B-shaped engine (config.json only, load_format="dummy", bf16): the
                 decode step at batch 1/32/256 against weight bytes / copy bandwidth
  bench-kernels  `python -m pdserve.bench.kernels --skip-step`: decode attention against copy
  bandwidth

Results go to one folder ($OUT when set, else bench/results/gpu_check/): gpu_check.md (the
summary, also written to bench/results/gpu_check.md), gpu_check.json (every number),
gpu_check.log (every step's output) and kernels.md (bench.kernels' report).

The checkout is not installed there: every step's Python finds it as `pdserve.<folder>` (and its
tests as `tests.<module>`) through links in a folder on PYTHONPATH, never through the checkout
root, whose folders would shadow installed packages of the same name. `make gpu-dryrun`
(bench/gpu_dryrun.py) proves on a CPU that every module and test of these steps imports with
only the GPU machine's packages and the wheels.

    bash bench/gpu_check.sh                           # what `make gpu-check` runs
    python3 bench/gpu_check.py --only gpu,llama8b     # some steps
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

REPO_ROOT = Path(__file__).resolve().parents[1]

# A whole run takes at most 7 minutes, so that a second one fits in a quarter of an hour.
TOTAL_BUDGET_S = 420
REPORT_RESERVE_S = 10
IMPORT_CHECK_S = 5
WHEELS_DIR = REPO_ROOT / ".gpu-wheels"
SITE_DIR = Path(tempfile.gettempdir()) / "pdserve-gpu-check-site"
# The checkout is not installed on the GPU machine: a folder whose `pdserve` links to it makes
# its folders importable as `pdserve.<folder>`, as an installed wheel has them.
CHECKOUT_LINK_DIR = Path(tempfile.gettempdir()) / "pdserve-gpu-check-checkout"
# What the wheels bring (the GPU machine's image has none of them).
WHEEL_MODULES = ("zmq", "fastapi", "uvicorn", "pydantic", "starlette", "llguidance")
KERNEL_TESTS = (
    "tests/kernels/test_store_kv.py",
    "tests/kernels/test_decode_attention.py",
    "tests/kernels/test_prefill_attention.py",
    "tests/kernels/test_block_copy.py",
    "tests/kernels/test_triton_backend.py",
    "tests/kernels/test_gpu_tiles.py",
    "tests/kernels/test_fp8_kernels.py",
)
PARITY_TESTS = (
    "tests/engine/test_greedy_parity.py::test_greedy_equals_transformers_on_cuda_in_fp32",
    "tests/kernels/test_triton_parity.py",
    "tests/engine/test_gpu_cuda_graphs.py",
    "tests/engine/test_block_staging.py",
    "tests/kvtransfer/test_cuda_ipc.py",
    "tests/kvtransfer/test_gpu_staging.py",
)


@dataclass
class Context:
    out_dir: Path
    scratch: Path
    env: dict[str, str]
    python: str = sys.executable
    wheels_dir: Path = WHEELS_DIR
    site_dir: Path = SITE_DIR


@dataclass
class Outcome:
    status: str  # pass | fail | timeout | skipped
    seconds: float = 0.0
    detail: str = ""
    numbers: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    what: str
    run: Callable[[Context, float], Outcome]


# ---------------------------------------------------------------- the driver (this process)


def gpu_present() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return listed.returncode == 0 and "GPU" in listed.stdout


def run_child(argv: list[str], ctx: Context, limit_s: float, env: dict | None = None) -> int | None:
    """Runs argv with output appended to the log; its exit code, or None when it ran past
    `limit_s` (then its whole process group is stopped)."""
    log = ctx.out_dir / "gpu_check.log"
    with open(log, "a", encoding="utf-8") as sink:
        sink.write(f"\n$ {shlex.join(argv)}\n")
        sink.flush()
        child = subprocess.Popen(
            argv, cwd=REPO_ROOT, env=env or ctx.env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return child.wait(timeout=max(limit_s, 1))
        except subprocess.TimeoutExpired:
            stop_group(child)
            sink.write(f"\n[gpu-check] stopped after its limit of {limit_s:.0f} s\n")
            return None


def stop_group(child: subprocess.Popen) -> None:
    """SIGTERM to the child's whole process group, 5 s to exit, then SIGKILL to whatever of
    the group is left (servers it started that drain slowly hold GPU memory)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            break
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def checkout_env(base: dict[str, str], site_dir: Path, link_dir: Path) -> dict[str, str]:
    """The environment of every step's Python: the wheels' folder `site_dir` first on
    PYTHONPATH, then `link_dir`, whose links `pdserve` (the checkout) and `tests` make them
    importable as an installed wheel has them; PYTHONSAFEPATH keeps the working directory (the
    checkout root) off every sys.path, so `kernels` is never our folder."""
    link_dir.mkdir(parents=True, exist_ok=True)
    for name, target in (("pdserve", REPO_ROOT), ("tests", REPO_ROOT / "tests")):
        link = link_dir / name
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    env = {**base, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONSAFEPATH": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site_dir), str(link_dir), base.get("PYTHONPATH", "")) if p
    )
    return env


def step_wheels(ctx: Context, limit_s: float) -> Outcome:
    """Every wheel of .gpu-wheels (one consistent set, downloaded with its dependencies) goes
    into the site folder (SITE_DIR), which comes first on PYTHONPATH: those packages are the
    versions the tests ran with elsewhere, whatever older copies the machine holds; torch is
    not among them."""
    check = [ctx.python, "-c", f"import {', '.join(WHEEL_MODULES)}"]
    if run_child(check, ctx, IMPORT_CHECK_S) == 0:
        return Outcome("pass", detail="every package of the wheels is importable already")
    wheels = sorted(ctx.wheels_dir.glob("*.whl"))
    if not wheels:
        return Outcome(
            "fail", detail=f"{ctx.wheels_dir.name}/ holds no wheels: run `make gpu-wheels`"
        )
    install = [
        ctx.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
        "--disable-pip-version-check", "--upgrade", "--target", str(ctx.site_dir),
        *map(str, wheels),
    ]
    installed = run_child(install, ctx, limit_s - 2 * IMPORT_CHECK_S)
    if installed != 0 or run_child(check, ctx, IMPORT_CHECK_S) != 0:
        return Outcome("fail", detail=f"{', '.join(WHEEL_MODULES)} do not import; see the log")
    names = sorted(wheel.name.split("-")[0] for wheel in wheels)
    return Outcome(
        "pass", detail=f"{len(wheels)} wheels into {ctx.site_dir.name}/", numbers={"installed": names}
    )


def internal_step(name: str) -> Callable[[Context, float], Outcome]:
    """A step that runs `python -m pdserve.bench.gpu_checks NAME SCRATCH` and reads what it
    wrote."""

    def run(ctx: Context, limit_s: float) -> Outcome:
        result_path = ctx.scratch / f"{name}.json"
        argv = [ctx.python, "-m", "pdserve.bench.gpu_checks", name, str(ctx.scratch)]
        code = run_child(argv, ctx, limit_s)
        if code is None:
            return Outcome("timeout", detail=f"stopped after {limit_s:.0f} s")
        if not result_path.exists():
            return Outcome("fail", detail=f"exited with status {code} before writing a result")
        result = json.loads(result_path.read_text())
        ok = result["ok"] and code == 0
        return Outcome("pass" if ok else "fail", detail=result["detail"], numbers=result["numbers"])

    return run


@dataclass(frozen=True)
class PytestStep:
    """A step that runs `targets` under pytest with the Triton kernels compiled
    (TRITON_INTERPRET=0), on `workers` processes, one test file each, where pytest-xdist is
    there; it passes when pytest does and ran some test."""

    name: str
    targets: tuple[str, ...]
    workers: int

    def __call__(self, ctx: Context, limit_s: float) -> Outcome:
        junit = ctx.scratch / f"{self.name}.xml"
        argv = [ctx.python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                f"--junitxml={junit}", *self.targets]
        if self.workers > 1 and importlib.util.find_spec("xdist") is not None:
            argv += ["-n", str(self.workers), "--dist", "loadfile"]
        code = run_child(argv, ctx, limit_s, env={**ctx.env, "TRITON_INTERPRET": "0"})
        counts = junit_counts(junit) if junit.exists() else {}
        if code is None:
            return Outcome("timeout", detail=f"stopped after {limit_s:.0f} s", numbers=counts)
        summary = ", ".join(f"{v} {k}" for k, v in counts.items() if k != "failing")
        failing = counts.get("failing", [])
        detail = summary + (f"; failing: {', '.join(failing[:6])}" if failing else "")
        ok = code == 0 and counts.get("passed", 0) > 0
        return Outcome("pass" if ok else "fail", detail=detail or f"exit {code}", numbers=counts)


def junit_counts(path: Path) -> dict:
    root = ElementTree.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failing": []}
    for case in root.iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        name = f"{module}::{case.get('name')}" if module else str(case.get("name"))
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            counts["failing"].append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def command_step(name: str, argv: Callable[[Context], list[str]]):
    def run(ctx: Context, limit_s: float) -> Outcome:
        code = run_child(argv(ctx), ctx, limit_s)
        if code is None:
            return Outcome("timeout", detail=f"stopped after {limit_s:.0f} s")
        return Outcome("pass" if code == 0 else "fail", detail=f"exit {code}")

    return run


# The limits add up to TOTAL_BUDGET_S - REPORT_RESERVE_S (bench/gpu_dryrun.py checks it). Each
# is at least 1.3x what the step took on an H200 (bench/results/gpu_check.md): parity's slowest
# file, greedy parity on five tiny models, took 99 s there beside the other five.
STEPS = (
    Step("wheels", 20, "serving packages and llguidance installed offline from .gpu-wheels",
         step_wheels),
    Step("gpu", 20, "device, shared memory, tiles, copy bandwidth", internal_step("gpu")),
    Step("kernels", 60, "Triton kernel tests compiled, fp32/fp16/bf16 and an fp8 KV cache",
         PytestStep("kernels", KERNEL_TESTS, workers=len(KERNEL_TESTS))),
    Step("parity", 140, "greedy parity vs transformers, CUDA graphs on/off, GPU copies",
         PytestStep("parity", PARITY_TESTS, workers=len(PARITY_TESTS))),
    Step("cuda-ipc", 30, "KV over cuda_ipc, two processes mapped as the launcher does",
         internal_step("cuda-ipc")),
    Step("serve-1p1d", 80, "1P1D vs colocated on one GPU over HTTP, same greedy text",
         internal_step("serve-1p1d")),
    Step("llama8b", 40, "Llama-3-8B-shaped decode step, dummy bf16 weights",
         internal_step("llama8b")),
    Step("bench-kernels", 20, "decode attention vs copy bandwidth (bench.kernels)",
         command_step("bench-kernels", lambda ctx: [
             ctx.python, "-m", "pdserve.bench.kernels", "--skip-step", "--copy-gib", "2",
             "--output", str(ctx.out_dir / "kernels.md")])),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated step names")
    args = parser.parse_args(argv)
    if not gpu_present():
        print("gpu-check: no NVIDIA GPU is present on this machine (nvidia-smi lists none); "
              "nothing was run.")
        return 0
    out_env = os.environ.get("OUT")
    out_dir = Path(out_env) if out_env else REPO_ROOT / "bench/results/gpu_check"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.log").write_text("", encoding="utf-8")
    wanted = set(args.only.split(",")) if args.only else {s.name for s in STEPS}
    unknown = wanted - {s.name for s in STEPS}
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; valid: {[s.name for s in STEPS]}")
    env = checkout_env(dict(os.environ), SITE_DIR, CHECKOUT_LINK_DIR)
    started = time.monotonic()
    outcomes: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        ctx = Context(out_dir, Path(scratch), env)
        for step in STEPS:
            if step.name not in wanted:
                continue
            left = TOTAL_BUDGET_S - REPORT_RESERVE_S - (time.monotonic() - started)
            if left < 10:
                outcomes[step.name] = Outcome("skipped", detail="no time left in the budget")
                continue
            limit = min(step.limit_s, left)
            print(f"[gpu-check] {step.name} (limit {limit:.0f} s): {step.what}", flush=True)
            begun = time.monotonic()
            try:
                outcome = step.run(ctx, limit)
            except Exception as error:  # noqa: BLE001 (a broken step must not stop the others)
                outcome = Outcome("fail", detail=f"{type(error).__name__}: {error}")
            outcome.seconds = time.monotonic() - begun
            outcomes[step.name] = outcome
            print(f"[gpu-check] {step.name}: {outcome.status} in {outcome.seconds:.0f} s; "
                  f"{outcome.detail}", flush=True)
    total = time.monotonic() - started
    text = report(outcomes, total, out_dir)
    (out_dir / "gpu_check.md").write_text(text, encoding="utf-8")
    (REPO_ROOT / "bench/results").mkdir(parents=True, exist_ok=True)
    (REPO_ROOT / "bench/results/gpu_check.md").write_text(text, encoding="utf-8")
    numbers = {name: {"status": o.status, "seconds": round(o.seconds, 1), "detail": o.detail,
                      **o.numbers} for name, o in outcomes.items()}
    (out_dir / "gpu_check.json").write_text(json.dumps(numbers, indent=1), encoding="utf-8")
    print("\n" + text, flush=True)
    return 0 if all(o.status == "pass" for o in outcomes.values()) else 1


# ---------------------------------------------------------------- the report


def report(outcomes: dict[str, Outcome], total_s: float, out_dir: Path) -> str:
    gpu = outcomes.get("gpu", Outcome("skipped")).numbers
    lines = [
        "# GPU check (`make gpu-check`)",
        "",
        (
            f"Command: `bash bench/gpu_check.sh`; {time.strftime('%Y-%m-%d %H:%M %Z')}; "
            f"total {total_s:.0f} s of a {TOTAL_BUDGET_S} s budget."
        ),
        (
            f"Machine: {gpu.get('gpu', '?')}; torch {gpu.get('torch', '?')}, triton "
            f"{gpu.get('triton', '?')}, Python {platform.python_version()}, {platform.machine()}."
        ),
        "",
        "| step | proves | result | seconds | notes |",
        "|---|---|---|---|---|",
    ]
    for step in STEPS:
        if step.name in outcomes:
            o = outcomes[step.name]
            verdict = {"pass": "pass", "fail": "**FAIL**", "timeout": "**TIMEOUT**"}.get(
                o.status, o.status
            )
            notes = o.detail.replace("|", "/").replace("\n", " ")[:300]
            lines.append(f"| {step.name} | {step.what} | {verdict} | {o.seconds:.0f} | {notes} |")
    if gpu:
        lines += ["", "## Device", ""]
        lines += [f"- {key}: {value}" for key, value in gpu.items()]
    ipc = outcomes.get("cuda-ipc")
    if ipc is not None and ipc.numbers:
        lines += ["", "## cuda_ipc between two processes on one GPU", ""]
        lines += [f"- {key}: {value}" for key, value in ipc.numbers.items()]
    serve = outcomes.get("serve-1p1d")
    if serve is not None and serve.numbers:
        lines += ["", "## 1P1D vs colocated over HTTP", ""]
        lines += [f"- {key}: {value}" for key, value in serve.numbers.items()]
    kernels_md = out_dir / "kernels.md"
    if "bench-kernels" in outcomes and kernels_md.exists():
        body = kernels_md.read_text(encoding="utf-8").split("\n", 1)[-1]
        lines += ["", "## Decode attention vs copy bandwidth (bench.kernels)", "", body.strip()]
    llama = outcomes.get("llama8b")
    if llama is not None and llama.numbers.get("runs"):
        lines += llama_table(llama.numbers)
    return "\n".join(lines) + "\n"


def llama_table(numbers: dict) -> list[str]:
    lines = [
        "",
        (
            f"## Llama-3-8B-shaped decode step (dummy bf16 weights, {numbers['context']} tokens of "
            "prompt each, CUDA graphs as the engine defaults)"
        ),
        "",
        (f"Weights streamed per step: {numbers['weight_bytes'] / 1e9:.2f} GB; copy bandwidth "
        f"{numbers['copy_bandwidth'] / 1e9:,.0f} GB/s (read + written). Floor = bytes / copy "
        "bandwidth; the step is `engine.step()` (schedule, metadata, forward, sampling)."),
        "",
        (
            "| batch | step (ms) | tokens/s | KV read (GB) | floor, weights (ms) | floor / step | "
            "floor, weights + KV (ms) | floor / step |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in numbers["runs"]:
        step = run["step_ms"]
        lines.append(
            f"| {run['batch']} | {step:.2f} | {run['batch'] / step * 1e3:,.0f} | "
            f"{run['kv_bytes'] / 1e9:.2f} | {run['floor_weights_ms']:.2f} | "
            f"**{run['floor_weights_ms'] / step:.0%}** | {run['floor_all_ms']:.2f} | "
            f"{run['floor_all_ms'] / step:.0%} |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
