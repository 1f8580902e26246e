"""What the router's /metrics says about each node: one per-node metric read out of the text, and
the wait until every live node's KV cache is idle with no leaked blocks, which bench/soak.py
measures and tests/fault_checks.py asserts at the end of every fault scenario."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def parse_metric(text: str, name: str, label: str = "node") -> dict[str, float]:
    """`label`'s value (the node id by default) -> value, of each sample of metric `name`."""
    return {
        sample.labels.get(label, ""): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def wait_for_clean_kv(url: str, settled_s: float, timeout_s: float) -> dict:
    """Scrapes the router at `url` until every live node's KV usage
    (`pdserve_kv_cache_usage_ratio`) and leaked blocks (`pdserve_kv_leaked_blocks`, from its
    idle-time integrity check) have been 0 in every scrape for `settled_s`, or until `timeout_s`.

    /metrics shows each node's latest NodeStats, which may predate the end of its requests (a
    node skips stats while its outbox is full) or its first idle-time leak check, and nothing in
    it says which; hence the clean state must hold for `settled_s`, a few heartbeats, in which
    each idle node sends stats taken after a leak check. Returns {"clean", "waited_s", "nodes":
    live node id -> {"usage", "leaked_blocks"} of the last scrape}."""
    start, clean_since, state = time.monotonic(), None, {}
    while time.monotonic() - start < timeout_s:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        up = parse_metric(text, "pdserve_node_up")
        usage = parse_metric(text, "pdserve_kv_cache_usage_ratio")
        leaked = parse_metric(text, "pdserve_kv_leaked_blocks")
        state = {
            node: {"usage": usage.get(node), "leaked_blocks": leaked.get(node)}
            for node, alive in up.items()
            if alive == 1.0
        }
        now = time.monotonic()
        if all(v == {"usage": 0.0, "leaked_blocks": 0.0} for v in state.values()):
            clean_since = now if clean_since is None else clean_since
            if now - clean_since >= settled_s:
                return {"clean": True, "waited_s": now - start, "nodes": state}
        else:
            clean_since = None
        time.sleep(0.1)
    return {"clean": False, "waited_s": time.monotonic() - start, "nodes": state}
