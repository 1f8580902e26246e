"""The machine a benchmark runs on, as the report records it: CPU, cores, library versions,
load average, and the command line that started the run."""

from __future__ import annotations

import datetime
import os
import platform
import sys

import torch


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


# The CPU flags that decide which compiled path runs (kernels/): vector width, FMA, bf16 and
# int8 dot products, matrix tiles; ARM's NEON (asimd), SVE and bf16.
VECTOR_FLAGS = (
    "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "bf16", "i8mm",
)


def cpu_vector_flags() -> str:
    """This CPU's flags of VECTOR_FLAGS, from /proc/cpuinfo ("unknown" where it is absent)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    present = set(value.split())
                    return " ".join(f for f in VECTOR_FLAGS if f in present) or "none of note"
    except OSError:
        pass
    return "unknown"


def machine_info() -> dict[str, str]:
    import transformers

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cpu vector flags": cpu_vector_flags(),
        "cores": f"{cores} usable ({os.cpu_count()} online)",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads",
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load average at start": load_average(),
    }


def report_head(title: str, machine: dict[str, str]) -> list[str]:
    """A Markdown report's first lines: its title, the command that wrote it, the machine."""
    return [
        f"# {title}",
        "",
        f"Command: `{command_line()}`",
        "",
        "| machine |  |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in machine.items()),
        "",
    ]


def load_average() -> str:
    """1-minute load average: other processes on this small machine skew every number."""
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"
