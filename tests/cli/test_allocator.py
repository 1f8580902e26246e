"""The allocator a CPU deployment runs with (commands/allocator.py): tcmalloc where the host has
it, loaded into the router and every node; the C library's malloc where it is absent, on GPU
hosts, with PDSERVE_ALLOCATOR=system, or when LD_PRELOAD is already set."""

from __future__ import annotations

import os

import httpx
import pytest

from pdserve.bench.server_processes import server_processes
from pdserve.commands.allocator import allocator_environment, find_tcmalloc
from pdserve.commands.serve_process import ServeProcess


def test_tcmalloc_is_preloaded_where_it_exists_on_a_cpu_host(tmp_path):
    library = tmp_path / "libtcmalloc_minimal.so.4"
    places = (str(tmp_path / "absent.so"), str(library))
    assert allocator_environment({}, False, places) == (
        {}, "the C library's malloc (no tcmalloc: `apt install libtcmalloc-minimal4`)"
    )
    library.write_bytes(b"")
    assert allocator_environment({}, False, places) == (
        {"LD_PRELOAD": str(library)}, f"tcmalloc ({library})"
    )
    assert allocator_environment({"PDSERVE_ALLOCATOR": "auto"}, False, places)[0] == {
        "LD_PRELOAD": str(library)
    }


def test_the_operator_and_gpu_hosts_keep_their_allocator(tmp_path):
    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.write_bytes(b"")
    places = (str(library),)
    assert allocator_environment({"PDSERVE_ALLOCATOR": "system"}, False, places) == (
        {}, "the C library's malloc (PDSERVE_ALLOCATOR=system)"
    )
    assert allocator_environment({"LD_PRELOAD": "/opt/libjemalloc.so"}, False, places) == (
        {}, "LD_PRELOAD as the environment sets it"
    )
    assert allocator_environment({}, True, places) == ({}, "the C library's malloc (GPU host)")
    with pytest.raises(ValueError, match="PDSERVE_ALLOCATOR='jemalloc': expected one of auto"):
        allocator_environment({"PDSERVE_ALLOCATOR": "jemalloc"}, False, places)


def _maps_tcmalloc(pid: int) -> bool:
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as maps:
        return "libtcmalloc" in maps.read()


@pytest.mark.skipif(
    find_tcmalloc() is None or bool(os.environ.get("LD_PRELOAD")),
    reason="tcmalloc is not installed on this host (make install installs it), or LD_PRELOAD "
    "is set",
)
def test_every_process_of_a_deployment_runs_on_tcmalloc_and_serves(tiny_llama_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    server = ServeProcess(
        ["--model", str(tiny_llama_dir), "--prefill", "1", "--decode", "1"],
        log_path=log_path, environment={"PDSERVE_ALLOCATOR": "auto"},
    )
    try:
        children = server_processes(server.process.pid)
        assert {"router", "prefill-0", "decode-0"} <= set(children), children
        assert all(_maps_tcmalloc(pid) for pid in children.values()), children
        body = {"model": tiny_llama_dir.name, "prompt": "hi", "max_tokens": 4}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        server.close()
    assert f"processes allocate with tcmalloc ({find_tcmalloc()})" in log_path.read_text()
