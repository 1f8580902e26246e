"""NodeStats for tests, from flat keywords: `node_stats(role="decode", num_free_blocks=3)` puts
each keyword into the part that has a field of that name (wire/node_stats.py; no two parts
share one), so a test names only what it varies. The message itself has one, nested, spelling
(`stats.kv.num_free_blocks`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.wire.messages import NodeStats
from pdserve.wire.node_stats import NODE_STATS_PARTS

# What an idle colocated node with 10 free blocks of 10 reports.
DEFAULTS: dict[str, Any] = {
    "node_id": "n0",
    "role": "colocated",
    "max_model_len": 512,
    "vocab_size": 512,
    "num_waiting": 0,
    "num_running": 0,
    "num_preemptions": 0,
    "num_free_blocks": 10,
    "num_total_blocks": 10,
}
_PART_BY_NAME = {part.__name__: part for part in NODE_STATS_PARTS}


def node_stats(**fields: Any) -> NodeStats:
    """NodeStats of `DEFAULTS` updated by `fields`, any part's field names; TypeError for a name
    no part has."""
    values = {**DEFAULTS, **fields}
    parts = {}
    for spec in dataclasses.fields(NodeStats):
        part = _PART_BY_NAME[spec.type]
        names = {f.name for f in dataclasses.fields(part)} & values.keys()
        parts[spec.name] = part(**{name: values.pop(name) for name in names})
    if values:
        raise TypeError(f"no part of NodeStats has fields {sorted(values)}")
    return NodeStats(**parts)
