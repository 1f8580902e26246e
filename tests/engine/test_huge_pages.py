"""Zeroed CPU memory on huge pages (engine/cpu/huge_pages.py): zeros of the size asked, on a 2 MiB
boundary, backed by 2 MiB pages where Linux's transparent huge pages are enabled; and the CPU KV
cache, which lives there, starts zeroed in its shape and dtype."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from pdserve.engine.cpu.huge_pages import HUGE_PAGE, zeroed_cpu_bytes
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_allowed() -> bool:
    """Whether madvise(MADV_HUGEPAGE) can give this process huge pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not THP_SETTING.exists():
        return False
    return "[never]" not in THP_SETTING.read_text()


def huge_page_kib(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("num_bytes", [0, 1000, HUGE_PAGE, 5 * HUGE_PAGE + 12345])
def test_the_memory_is_zeros_of_the_size_asked_and_writable(num_bytes):
    memory = zeroed_cpu_bytes(num_bytes)
    assert memory.dtype == torch.uint8 and memory.shape == (num_bytes,)
    assert not memory.any()
    memory.fill_(7)
    assert int(memory.sum()) == 7 * num_bytes
    if num_bytes >= HUGE_PAGE:
        assert memory.data_ptr() % HUGE_PAGE == 0


def test_two_buffers_do_not_share_memory():
    first, second = zeroed_cpu_bytes(3 * HUGE_PAGE), zeroed_cpu_bytes(3 * HUGE_PAGE)
    first.fill_(1)
    assert not second.any()


@pytest.mark.skipif(not thp_allowed(), reason="transparent huge pages are off here")
def test_the_memory_lies_on_huge_pages_where_linux_offers_them():
    memory = zeroed_cpu_bytes(8 * HUGE_PAGE)
    assert huge_page_kib(memory.data_ptr()) >= HUGE_PAGE // 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_cpu_kv_cache_starts_zeroed_in_its_shape_and_dtype(dtype):
    spec = KVCacheSpec(2, 3, 64, 16, dtype)
    cache = KVCache(spec, 300, torch.device("cpu"))
    assert cache.buffer.shape == spec.buffer_shape(300) and cache.buffer.dtype == dtype
    assert cache.buffer.is_contiguous()
    assert not cache.buffer.view(torch.uint8).any()
    cache.key_cache(1)[5].view(torch.uint8).fill_(1)
    written = cache.key_cache(1)[5].view(torch.uint8).numel()
    assert int(cache.buffer.view(torch.uint8).sum()) == written
