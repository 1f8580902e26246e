"""Block accounting: allocation, freeing, sharing, copy-on-write, integrity checks."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.wire.sampling_params import SamplingParams


def make_seq(name: str, num_tokens: int) -> Sequence:
    return Sequence(name, [1] * num_tokens, SamplingParams(), frozenset(), torch.device("cpu"))


def test_allocation_grows_block_tables_by_whole_blocks():
    manager = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq("a", 9)
    assert manager.allocate_slots(seq, 9)
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 9
    assert manager.allocate_slots(seq, 3)
    assert len(seq.block_table) == 3
    assert manager.allocate_slots(seq, 4)
    assert len(seq.block_table) == 4
    manager.check_integrity([seq.block_table])
    manager.free(seq)
    assert manager.num_free_blocks == 10
    manager.check_integrity([])


def test_allocation_that_does_not_fit_changes_nothing():
    manager = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq("a", 20)
    assert not manager.allocate_slots(seq, 20)
    assert seq.block_table == [] and manager.num_free_blocks == 3
    assert not manager.allocate_slots(seq, 8, reserve=2)
    assert manager.allocate_slots(seq, 8, reserve=1)


def test_fork_shares_blocks_and_copy_on_write_makes_the_written_one_private():
    manager = BlockManager(num_blocks=8, block_size=4)
    parent, child = make_seq("p", 6), make_seq("c", 6)
    manager.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    manager.fork(parent, child)
    child.num_computed_tokens = 6
    assert child.block_table == parent.block_table
    assert [manager.ref_counts[b] for b in parent.block_table] == [2, 2]
    manager.check_integrity([parent.block_table, child.block_table])

    copies = manager.copy_on_write(child, 1)
    shared_full, shared_partial = parent.block_table
    assert len(copies) == 1 and copies[0][0] == shared_partial
    assert child.block_table[0] == shared_full
    assert child.block_table[1] == copies[0][1] != shared_partial
    assert manager.ref_counts[shared_partial] == 1
    manager.check_integrity([parent.block_table, child.block_table])
    assert manager.copy_on_write(child, 1) == []

    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 8
    manager.check_integrity([])


def test_copy_on_write_without_free_blocks_changes_nothing():
    manager = BlockManager(num_blocks=2, block_size=4)
    parent, child = make_seq("p", 8), make_seq("c", 8)
    manager.allocate_slots(parent, 8)
    manager.fork(parent, child)
    child.num_computed_tokens = 4
    before = list(child.block_table)
    assert manager.copy_on_write(child, 1) is None
    assert child.block_table == before


def test_integrity_check_catches_corruption():
    manager = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq("a", 4)
    manager.allocate_slots(seq, 4)
    manager.free_block_ids.append(seq.block_table[0])
    with pytest.raises(RuntimeError):
        manager.check_integrity()
    manager.free_block_ids.pop()
    manager.check_integrity([seq.block_table])
    with pytest.raises(RuntimeError, match="ref counts"):
        manager.check_integrity([])


def test_double_free_is_refused():
    manager = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq("a", 4)
    manager.allocate_slots(seq, 4)
    table = list(seq.block_table)
    manager.free(seq)
    seq.block_table = table
    with pytest.raises(RuntimeError, match="freed while not in use"):
        manager.free(seq)


def test_random_operations_keep_the_accounting_exact():
    rng = random.Random(7)
    manager = BlockManager(num_blocks=64, block_size=8)
    live: list[Sequence] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.4 or not live:
            seq = make_seq(f"s{step}", rng.randrange(1, 100))
            if manager.allocate_slots(seq, seq.num_tokens):
                seq.num_computed_tokens = seq.num_tokens
                live.append(seq)
        elif op < 0.6:
            parent = rng.choice(live)
            child = make_seq(f"c{step}", parent.num_tokens)
            manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            live.append(child)
        elif op < 0.85:
            seq = rng.choice(live)
            grow = rng.randrange(1, 20)
            if manager.allocate_slots(seq, grow) and manager.copy_on_write(seq, grow) is not None:
                seq.token_ids.extend([1] * grow)
                seq.num_computed_tokens += grow
        else:
            seq = live.pop(rng.randrange(len(live)))
            manager.free(seq)
        manager.check_integrity([s.block_table for s in live])
    for seq in live:
        manager.free(seq)
    assert manager.num_free_blocks == 64
