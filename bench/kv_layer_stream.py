"""The KV transfer bench's third section: for prompts of one chunk, the time from the prefill's
last layer to the decode node's commit, with the chunk's KV written after the forward (one
write of every layer) and by layer group while the forward runs (`--kv-layers-per-write`'s
default: a quarter of the layers per write).

The default model prefills each prompt in one chunk (a real forward, `PrefillEngine` as a prefill
node drives it); its writes go to a decode peer in another process (bench/kv_transfer.py's
`DecodePeer`). A forward hook on the model's last layer stamps when that layer finished; the
sender's COMPLETE (the decode side committed: every block of every layer landed) ends the
measure. The decode node starts the request's first decode step at its commit, so its first
token comes one decode step after it in both modes: the difference between the modes is the
difference in time to first decode token.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from pdserve.bench.kv_transfer import TRANSPORTS, DecodePeer, connect_senders, say
from pdserve.kvtransfer import TransferKind

PROMPT_TOKENS = (128, 512, 1024)


def layer_stream_rows(args, logs: Path) -> tuple[list[list[str]], str]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kvtransfer.fingerprint import model_fingerprint
    from pdserve.prefill_node.prefill_engine import BlockWrite, PrefillEngine
    from pdserve.wire.sampling_params import SamplingParams

    longest = max(PROMPT_TOKENS)
    engine = LLMEngine(EngineConfig(
        model=args.model, max_num_batched_tokens=longest, num_kv_blocks=2 * longest // 16 + 8,
        enable_prefix_caching=False,
    ))
    spec = engine.runner.kv_cache.spec
    num_layers = spec.num_layers
    group_layers = -(-num_layers // 4)
    modes = {"after the forward": num_layers, f"groups of {group_layers} layers": group_layers}
    fingerprint = model_fingerprint(engine.model_config)
    decode = DecodePeer(logs / "decode-layer-stream.log", spec, longest // 16, fingerprint)
    senders = connect_senders(decode, engine.runner.kv_cache, fingerprint)
    last_layer_at: list[float] = []
    hook = engine.runner.model.layers[-1].register_forward_hook(
        lambda *_: last_layer_at.append(time.perf_counter())
    )
    rng = random.Random(0)
    counter = iter(range(10**9))
    repeats = max(args.repeats, 5)

    def one_prefill(
        transport: str, num_tokens: int, layers_per_write: int
    ) -> tuple[float, float, int]:
        """(seconds from the last layer to COMPLETE, from the step's start to COMPLETE, writes
        issued before the last layer)."""
        request_id = f"stream-{next(counter)}"
        dst = list(range(-(-num_tokens // 16)))
        decode.expect(transport, request_id, dst)
        prefill = PrefillEngine(engine, layers_per_write)
        prompt = [rng.randrange(1000, 20000) for _ in range(num_tokens)]
        prefill.add(request_id, prompt, SamplingParams(max_tokens=1), dst)
        sender, early = senders[transport], []
        started = time.monotonic()

        def issue(write: BlockWrite) -> None:
            early.append(not last_layer_at)
            end = num_layers if write.layer_end is None else write.layer_end
            pace_s = (time.monotonic() - started) * num_layers / end
            sender.write(request_id, write.src_block_ids, write.dst_block_ids, pace_s,
                         write.layer_start, write.layer_end)

        last_layer_at.clear()
        step_started = time.perf_counter()
        step = prefill.step(issue)
        assert step.first_tokens and len(last_layer_at) == 1, "the prompt took more than a step"
        event = sender.wait(request_id, 120)
        committed = time.perf_counter()
        assert event.kind is TransferKind.COMPLETE, event
        decode.wait(transport, request_id)
        prefill.release(request_id)
        return committed - last_layer_at[0], committed - step_started, sum(early)

    rows = []
    try:
        for transport in TRANSPORTS:
            one_prefill(transport, longest, group_layers)  # warm-up
            for num_tokens in PROMPT_TOKENS:
                results = {}
                for mode, layers_per_write in modes.items():
                    runs = [one_prefill(transport, num_tokens, layers_per_write)
                            for _ in range(repeats)]
                    results[mode] = [statistics.median(r[i] for r in runs) for i in range(3)]
                before, after = results["after the forward"], results[list(modes)[1]]
                kib = -(-num_tokens // 16) * spec.bytes_per_block / 1024
                rows.append([
                    transport, str(num_tokens), f"{kib:,.0f} KiB", f"{before[0] * 1e3:.1f}",
                    f"{after[0] * 1e3:.1f}", f"**{before[0] / after[0]:.1f}x**",
                    f"{before[1] * 1e3:.0f}", f"{after[1] * 1e3:.0f}", f"{after[2]:.0f}",
                ])
                say(f"  layer stream {transport} {num_tokens}: " + " | ".join(rows[-1][2:]))
    finally:
        hook.remove()
        for sender in senders.values():
            sender.close()
        decode.stop()
    setup = (
        f"Model `{engine.model_path.name}` ({num_layers} layers), each prompt prefilled in one "
        f"chunk (max_num_batched_tokens {longest}), decode side in a second process; median of "
        f"{repeats} runs per cell after a warm-up. Before: the chunk's KV is written after the "
        f"forward (`--kv-layers-per-write {num_layers}`); after: by layer group as the forward "
        f"computes it (`--kv-layers-per-write {group_layers}`, the default). Measured: last "
        "layer computed (a forward hook) -> the sender's COMPLETE (the decode side committed "
        "every block of every layer). The decode node runs its first decode step at the commit, "
        "so its first token comes one decode step later in both columns. `step start -> commit`: "
        "the same from the start of the prefill step (forward, sampling and transfer). "
        "`early writes`: writes issued before the last layer ran (after the forward: 0)."
    )
    return rows, setup
