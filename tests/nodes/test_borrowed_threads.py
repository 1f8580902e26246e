"""A decode node's borrowed cores (decode_node/borrowed_threads.py): every core while none of
its prompts is being prefilled, its own share while one is, switched only on a change, and
nothing touched when the launcher lent it nothing."""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_node.borrowed_threads import BorrowedThreads


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_node_runs_every_core_only_while_nothing_is_prefilled_for_it(restore_threads):
    torch.set_num_threads(1)
    threads = BorrowedThreads(own=1, while_prefill_idle=2)
    threads.update(prefilling=False)
    assert torch.get_num_threads() == 2
    threads.update(prefilling=False)
    threads.update(prefilling=True)
    assert torch.get_num_threads() == 1
    threads.update(prefilling=True)
    threads.update(prefilling=False)
    assert torch.get_num_threads() == 2
    assert threads.switches == 3


def test_nothing_lent_leaves_the_thread_count_alone(restore_threads):
    torch.set_num_threads(1)
    threads = BorrowedThreads(own=None, while_prefill_idle=None)
    threads.update(prefilling=False)
    threads.update(prefilling=True)
    assert torch.get_num_threads() == 1 and threads.switches == 0
