"""Parity of greedy tokens between two systems on the same requests."""

from __future__ import annotations

from pdserve.bench.workload import Request


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
