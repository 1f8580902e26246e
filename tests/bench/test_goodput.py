"""The goodput bench's workload and verdicts, without servers: every layout gets the same
requests, chat turns share their system prompts, the single-stream load runs one request at a
time, and the goal line says "not met" whenever auto trails the best fixed layout."""

from __future__ import annotations

from pdserve.bench.goodput import SYSTEM_TOKENS, goal_lines, loads, parse_args, report


def test_the_loads_mix_chat_turns_on_shared_system_prompts_with_long_documents():
    args = parse_args(["--requests", "40", "--rates", "1.0", "--long-fraction", "0.25"])
    vocab = list(range(10, 510))
    first, second = loads(vocab, args), loads(vocab, args)
    assert [[r.prompt for reqs in runs for r in reqs] for runs, _ in first.values()] == [
        [r.prompt for reqs in runs for r in reqs] for runs, _ in second.values()
    ]
    assert first["1 stream"][1] == 1 and first["1.0 requests/s"][1] is None
    runs = first["1.0 requests/s"][0]
    assert len(runs) == args.repeats == 3
    # each repeat has prompts of its own (no prefix-cache hits across repeats), same times
    assert not {tuple(r.prompt[:SYSTEM_TOKENS]) for r in runs[0]} & {
        tuple(r.prompt[:SYSTEM_TOKENS]) for r in runs[1]
    }
    assert [r.at for r in runs[0]] == [r.at for r in runs[2]]
    requests = runs[0]
    chats = [r for r in requests if r.kind == "chat"]
    documents = [r for r in requests if r.kind == "document"]
    assert chats and documents and len(chats) + len(documents) == 40
    assert all(1200 <= len(r.prompt) <= 1600 and r.max_tokens == 16 for r in documents)
    systems = {tuple(r.prompt[:SYSTEM_TOKENS]) for r in chats}
    assert 1 < len(systems) <= 4  # shared prefixes, not one per request
    times = [r.at for r in requests]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] > 0


def summary(goodput: float, placements: dict | None = None) -> dict:
    return {
        "requests": 4, "completed": 4, "goodput": goodput, "slo_attainment": 1.0,
        "ttft_p50": 0.1, "ttft_p99": 0.2, "itl_p50": 0.02, "itl_p99": 0.05,
        "throughput_tok_s": 30.0, "placements": placements or {}, "goodput_runs": [goodput],
    }


def test_the_goal_is_met_only_where_auto_reaches_the_best_fixed_layout():
    results = {
        "colocated": {"1 stream": summary(1.0), "2.0 requests/s": summary(0.5)},
        "1p1d always": {"1 stream": summary(0.8), "2.0 requests/s": summary(0.9)},
        "1p1d auto": {
            "1 stream": summary(0.95, {"local": 4.0}),
            "2.0 requests/s": summary(0.9, {"local": 3.0, "remote": 1.0}),
        },
    }
    lines = goal_lines(results)
    assert lines[0].startswith("- 1 stream: auto 0.950 vs best fixed (colocated) 1.000")
    assert lines[0].endswith("not met")
    assert "(1p1d always) 0.900" in lines[1] and lines[1].endswith(", met")
    text = report(parse_args(["--quick"]), {"cpu": "test"}, results)
    assert "| 1p1d auto | 4/4 | 0.900 |" in text and "local 3, remote 1" in text
