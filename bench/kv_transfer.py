"""KV transfer bandwidth per transport against memcpy, and how much of it chunked prefill hides.

1. Bandwidth. A decode peer process (`python -m pdserve.kvtransfer.peer`) registers a KV buffer
   shaped like the default model's (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, fp32, 16-token
   blocks, 720 KiB per block). This process writes the blocks of one transfer (1 to 512 MiB,
   consecutive block ids; shm and mooncake also with shuffled ids) and waits for the decode
   side's commit: GB/s = bytes / (write call -> COMPLETE), best of --repeats. Reference: a
   same-process contiguous torch copy of the same bytes, and for zmq and mooncake the raw
   ceiling, a plain TCP socket over loopback between two processes (sendall -> recv_into).
   mooncake runs where it is installed (`pip install 'pdserve[mooncake]'`), else its columns
   say so.
2. Overlap. The default model prefills a --prompt-tokens prompt in --chunk-tokens chunks
   (LLMEngine, real forward passes); after each chunk the blocks it completed are written to
   the decode peer as their own transfer. Runs: compute only; synchronous (wait for each chunk's
   transfer before the next chunk); overlapped (wait for all of them after the last chunk).
   Transfer time = time outside the forward passes; hidden share = 1 - overlapped transfer time
   / synchronous transfer time. The forward's own slowdown while copies run is shown beside it.

3. Layer streaming (bench/kv_layer_stream.py). Prompts of one chunk (128, 512, 1024 tokens):
   time from the prefill's last layer to the decode side's commit, the chunk's KV written after
   the forward and by layer group during it, side by side.

    python -m pdserve.bench.kv_transfer            # full run (a few minutes on 2 cores)
    python -m pdserve.bench.kv_transfer --quick    # 1-64 MiB, short prompt, one repeat
    python -m pdserve.bench.kv_transfer --sections layer-stream   # some sections: the report
                                                   # file keeps the others as they were
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

from pdserve.bench.machine import command_line, load_average, machine_info
from pdserve.bench.report import md_table
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.kvtransfer import ChannelSender, KVDescriptor, SenderConfig, TransferKind
from pdserve.kvtransfer.descriptor import dtype_name
from pdserve.kvtransfer.peer import PeerProcess
from pdserve.kvtransfer.transports.mooncake_engine import mooncake_missing

MIB = 2**20
GB = 1e9
DEFAULT_MODEL_KV = KVCacheSpec(
    num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32
)
TARGET_SHM, TARGET_ZMQ, TARGETS_FROM_MIB = 0.6, 0.3, 16
TARGET_MOONCAKE = TARGET_ZMQ  # a network transport, like zmq
MOONCAKE_MISSING = mooncake_missing()
TRANSPORTS = ("shm", "zmq") if MOONCAKE_MISSING else ("shm", "zmq", "mooncake")
SECTIONS = ("bandwidth", "overlap", "layer-stream")
LAYER_STREAM_HEADING = "## Time from last prefill layer to first decode token (one-chunk prompts)"
BANDWIDTH_CASES = ("shm", "shm shuffled", "zmq", "mooncake", "mooncake shuffled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--sizes-mib", type=int, nargs="+")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--chunk-tokens", type=int)
    parser.add_argument("--model", help="model folder for the overlap run (default model)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/kv_transfer.md")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
        help="the sections to run; the report file keeps the others' text (default: all)",
    )
    parser.add_argument("--tcp-sink", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sizes_mib = args.sizes_mib or ([1, 16, 64] if args.quick else [1, 4, 16, 64, 256, 512])
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.prompt_tokens = args.prompt_tokens or (768 if args.quick else 2048)
    args.chunk_tokens = args.chunk_tokens or (128 if args.quick else 256)
    if args.chunk_tokens < 16:
        parser.error("--chunk-tokens must be at least one block (16 tokens)")
    return args


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def best_seconds(run, repeats: int, min_total_s: float = 0.3, max_repeats: int = 200) -> float:
    """Best time after a warm-up call (page faults, thread pools, connections): at least
    `repeats` calls, more for short ones until `min_total_s` is spent (other processes share
    this machine's cores, so a single short call is mostly noise)."""
    run()
    times = []
    while len(times) < repeats or (sum(times) < min_total_s and len(times) < max_repeats):
        times.append(_timed(run))
    return min(times)


def _timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


class DecodePeer:
    """The decode side in another process; one receiver per transport."""

    def __init__(self, logs: Path, spec: KVCacheSpec, num_blocks: int, fingerprint: str) -> None:
        self.peer = PeerProcess(logs)
        self.descriptors: dict[str, KVDescriptor] = {}
        fields = {
            "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "block_size": spec.block_size,
            "dtype": dtype_name(spec.dtype),
        }
        for transport in TRANSPORTS:
            encoded = self.peer.call(
                "open_receiver", name=transport, transport=transport,
                node_id=f"bench-{transport}-{time.time_ns()}", spec=fields,
                num_blocks=num_blocks, fingerprint=fingerprint, timeout=120,
            )["descriptor"]
            self.descriptors[transport] = KVDescriptor.decode(bytes.fromhex(encoded))

    def expect(self, transport: str, transfer_id: str, block_ids: list[int]) -> None:
        self.peer.call("expect", name=transport, transfer_id=transfer_id, block_ids=block_ids,
                       deadline_s=120)

    def wait(self, transport: str, transfer_id: str) -> None:
        event = self.peer.call("wait", name=transport, transfer_id=transfer_id, wait_s=120,
                               timeout=130)
        assert event["kind"] == "complete", event

    def stop(self) -> None:
        self.peer.stop()


def connect_senders(decode: DecodePeer, local: KVCache, fingerprint: str) -> dict:
    senders = {}
    for transport in TRANSPORTS:
        sender = ChannelSender(transport, SenderConfig(grant_timeout_s=30))
        sender.connect(decode.descriptors[transport], local, fingerprint)
        senders[transport] = sender
    return senders


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    """The reference: a contiguous same-process memcpy of `nbytes` (numpy's copy: one thread,
    like memcpy and like the transports' own copies)."""
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    return best_seconds(functools.partial(np.copyto, target, source), repeats)


def timed_transfer(decode, sender, transport, src, dst, counter) -> float:
    transfer_id = f"bw-{next(counter)}"
    decode.expect(transport, transfer_id, dst)
    started = time.perf_counter()
    sender.write(transfer_id, src, dst)
    event = sender.wait(transfer_id, 120)
    elapsed = time.perf_counter() - started
    assert event.kind is TransferKind.COMPLETE, event
    decode.wait(transport, transfer_id)
    return elapsed


def tcp_sink() -> None:
    """Child process: receives length-prefixed payloads into one buffer, acks each."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    connection, _ = listener.accept()
    buffer = memoryview(bytearray(0))
    while header := connection.recv(8, socket.MSG_WAITALL):
        (size,) = struct.unpack("<q", header)
        if len(buffer) < size:
            buffer = memoryview(bytearray(size))
        received = 0
        while received < size:
            received += connection.recv_into(buffer[received:size])
        connection.sendall(b"k")


def measure_tcp(sizes: list[int], repeats: int) -> dict[int, float]:
    sink = subprocess.Popen([sys.executable, "-m", "pdserve.bench.kv_transfer", "--tcp-sink"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        connection = socket.create_connection(("127.0.0.1", int(sink.stdout.readline())))
        payload = memoryview(bytearray(max(sizes)))
        results = {}
        for size in sizes:
            def send(size=size):
                connection.sendall(struct.pack("<q", size))
                connection.sendall(payload[:size])
                connection.recv(1)
            results[size] = best_seconds(send, repeats)
        connection.close()
        return results
    finally:
        sink.wait(10)


def bandwidth_rows(args, logs: Path) -> tuple[list[list[str]], list[str]]:
    spec = DEFAULT_MODEL_KV
    block_counts = [math.ceil(size * MIB / spec.bytes_per_block) for size in args.sizes_mib]
    num_blocks = max(block_counts)
    say(f"bandwidth: {num_blocks} blocks of {spec.bytes_per_block / MIB:.2f} MiB per side")
    decode = DecodePeer(logs / "decode-bandwidth.log", spec, num_blocks, "bandwidth")
    local = KVCache(spec, num_blocks, torch.device("cpu"))
    local.buffer.fill_(1.0)
    senders = connect_senders(decode, local, "bandwidth")
    counter = iter(range(10**9))
    tcp = measure_tcp([n * spec.bytes_per_block for n in block_counts], args.repeats)
    rows, verdicts = [], []
    try:
        for size_mib, count in zip(args.sizes_mib, block_counts):
            nbytes = count * spec.bytes_per_block
            memcpy = memcpy_seconds(nbytes, args.repeats)
            blocks = list(range(count))
            shuffled = random.Random(count).sample(range(num_blocks), count)
            cases = {
                name: (name.split()[0], shuffled if name.endswith("shuffled") else blocks)
                for name in BANDWIDTH_CASES
                if name.split()[0] in TRANSPORTS
            }
            seconds = {
                name: best_seconds(
                    functools.partial(
                        timed_transfer, decode, senders[transport], transport, blocks, dst, counter
                    ),
                    args.repeats,
                )
                for name, (transport, dst) in cases.items()
            }
            ratios = {name: memcpy / s for name, s in seconds.items()}
            rows.append([
                f"{size_mib} MiB", f"{nbytes / MIB:.1f} MiB", f"{nbytes / memcpy / GB:.2f}",
                *(f"{nbytes / seconds[n] / GB:.2f} (**{ratios[n]:.2f}x**)" if n in seconds
                  else "not installed" for n in BANDWIDTH_CASES),
                f"{nbytes / tcp[nbytes] / GB:.2f} ({memcpy / tcp[nbytes]:.2f}x)",
            ])
            say(f"  {size_mib} MiB: " + ", ".join(f"{n} {r:.2f}x" for n, r in ratios.items()))
            if size_mib >= TARGETS_FROM_MIB:
                verdicts.append(_verdict("shm", size_mib, ratios["shm"], TARGET_SHM))
                verdicts.append(_verdict("zmq", size_mib, ratios["zmq"], TARGET_ZMQ))
                if "mooncake" in ratios:
                    verdicts.append(
                        _verdict("mooncake", size_mib, ratios["mooncake"], TARGET_MOONCAKE)
                    )
    finally:
        for sender in senders.values():
            sender.close()
        decode.stop()
    return rows, verdicts


def _verdict(transport: str, size_mib: int, ratio: float, target: float) -> str:
    met = "met" if ratio >= target else "NOT met"
    return f"{transport} at {size_mib} MiB: {ratio:.2f}x memcpy, target >= {target}x: {met}"


def overlap_rows(args, logs: Path) -> tuple[list[list[str]], str]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kvtransfer.fingerprint import model_fingerprint
    from pdserve.wire.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(
        model=args.model, max_num_batched_tokens=args.chunk_tokens,
        num_kv_blocks=2 * math.ceil(args.prompt_tokens / 16) + 8, enable_prefix_caching=False,
    ))
    kv_cache = engine.runner.kv_cache
    spec, block_size = kv_cache.spec, kv_cache.spec.block_size
    fingerprint = model_fingerprint(engine.model_config)
    num_prompt_blocks = math.ceil(args.prompt_tokens / block_size)
    decode = DecodePeer(logs / "decode-overlap.log", spec, num_prompt_blocks, fingerprint)
    senders = connect_senders(decode, kv_cache, fingerprint)
    chunk_ends = list(range(args.chunk_tokens, args.prompt_tokens, args.chunk_tokens))
    chunk_ends.append(args.prompt_tokens)
    block_ends = [end // block_size for end in chunk_ends[:-1]] + [num_prompt_blocks]
    rng = random.Random(0)
    counter = iter(range(10**9))

    def prefill(transport: str | None, synchronous: bool) -> tuple[float, float, float]:
        """(wall seconds, seconds inside forward passes, seconds the last chunk's write took in a
        synchronous run) of one chunked prefill."""
        request_id = f"overlap-{next(counter)}"
        prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_tokens)]
        chunks = [(s, e) for s, e in zip([0, *block_ends], block_ends) if e > s]
        if transport is not None:
            for index, (start, end) in enumerate(chunks):
                decode.expect(transport, f"{request_id}-{index}", list(range(start, end)))
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        seq, forward, issued, last_write = engine.sequences[request_id], 0.0, [], 0.0
        started = time.perf_counter()
        for index, (start, end) in enumerate(chunks):
            forward += _timed(engine.step)
            assert math.ceil(seq.num_computed_tokens / block_size) >= end
            if transport is None:
                continue
            transfer_id = f"{request_id}-{index}"
            write_started = time.perf_counter()
            senders[transport].write(transfer_id, seq.block_table[start:end],
                                     list(range(start, end)))
            issued.append(transfer_id)
            if synchronous:
                assert senders[transport].wait(transfer_id, 120).kind is TransferKind.COMPLETE
                last_write = time.perf_counter() - write_started
        for transfer_id in issued if not synchronous else []:
            assert senders[transport].wait(transfer_id, 120).kind is TransferKind.COMPLETE
        wall = time.perf_counter() - started
        engine.abort_request(request_id)
        for transfer_id in issued:
            decode.wait(transport, transfer_id)
        return wall, forward, last_write

    rows = []
    try:
        prefill(None, True)  # warm-up
        compute_runs = []
        for transport in TRANSPORTS:
            runs = {"sync": [], "overlapped": []}
            for _ in range(args.repeats):
                compute_runs.append(prefill(None, True))
                runs["sync"].append(prefill(transport, True))
                runs["overlapped"].append(prefill(transport, False))
            sync = min(runs["sync"])
            overlapped = min(runs["overlapped"])
            sync_transfer = sync[0] - sync[1]
            exposed = overlapped[0] - overlapped[1]
            earlier_chunks = sync_transfer - sync[2]
            compute = min(compute_runs)
            rows.append([
                transport, f"{compute[0]:.3f}", f"{sync[0]:.3f}", f"{sync_transfer * 1e3:.1f}",
                f"{overlapped[0]:.3f}", f"{exposed * 1e3:.1f}",
                f"**{100 * (1 - exposed / sync_transfer):.0f}%**",
                f"{100 * (1 - max(exposed - sync[2], 0) / earlier_chunks):.0f}%",
                f"{(overlapped[1] - compute[1]) * 1e3:+.0f} ms",
            ])
            say(f"  overlap {transport}: " + " | ".join(rows[-1][1:]))
    finally:
        for sender in senders.values():
            sender.close()
        decode.stop()
    setup = (
        f"Model `{engine.model_path.name}` ({spec.num_layers} layers, {spec.num_kv_heads} KV "
        f"heads, head dim {spec.head_dim}, {dtype_name(spec.dtype)}): a {args.prompt_tokens}-token"
        f" prompt in {len(chunk_ends)} chunks of {args.chunk_tokens} tokens, "
        f"{num_prompt_blocks * spec.bytes_per_block / MIB:.1f} MiB of KV; best of "
        f"{args.repeats} runs per mode."
    )
    return rows, setup


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tcp_sink:
        tcp_sink()
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info()
    say(f"command: {command_line()}\nmachine: {machine}")
    sections: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kv-transfer-bench-") as logs:
        if "bandwidth" in args.sections:
            sections["bandwidth"] = bandwidth_section(*bandwidth_rows(args, Path(logs)), args)
        if "overlap" in args.sections:
            sections["overlap"] = overlap_section(*overlap_rows(args, Path(logs)))
        if "layer-stream" in args.sections:
            from pdserve.bench.kv_layer_stream import layer_stream_rows

            sections["layer-stream"] = layer_stream_section(*layer_stream_rows(args, Path(logs)))
    machine["load average at end"] = load_average()
    header = "\n\n".join([
        "# KV transfer: bandwidth and overlap with chunked prefill",
        f"Command: `{command_line()}`",
        md_table(["machine", ""], [[k, v] for k, v in machine.items()]),
    ])
    if set(args.sections) == set(SECTIONS) or not args.output.exists():
        report = "\n\n".join([header, *sections.values()]) + "\n"
    else:  # a partial run: its sections, with their own command and machine, replace theirs
        report = args.output.read_text()
        for section in sections.values():
            heading, _, body = section.partition("\n\n")
            section = "\n\n".join([
                heading, f"Command: `{command_line()}`",
                md_table(["machine", ""], [[k, v] for k, v in machine.items()]), body,
            ])
            report = _replace_section(report, heading, section)
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    say(f"wrote {args.output}")


def _replace_section(report: str, heading: str, section: str) -> str:
    """`report` with the section under `heading` (up to the next "## ") replaced by `section`,
    or with `section` appended where it has none."""
    start = report.find(heading + "\n")
    if start < 0:
        return report.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    end = report.find("\n## ", start + len(heading))
    rest = report[end + 1:] if end >= 0 else ""
    return report[:start] + section.rstrip("\n") + "\n" + ("\n" + rest if rest else "")


def bandwidth_section(bandwidth: list[list[str]], verdicts: list[str], args) -> str:
    return "\n\n".join([
        "## Bandwidth (GB/s, ratio to a same-process memcpy of the same bytes)",
        (
            "memcpy: one thread copying the same number of contiguous bytes in this process. "
            "Below the last-level cache size it runs from cache, which no cross-process "
            f"transfer can match; the targets apply from {TARGETS_FROM_MIB} MiB."
        ),
        (
            "KV shaped like the default model's (30 layers, 3 KV heads, head dim 64, fp32, 720 "
            "KiB per block), decode side in a second process, timed from `write` to the sender's "
            f"COMPLETE (the decode side's commit), best of >= {args.repeats} after a warm-up. "
            "Raw TCP: the same bytes over one loopback socket between two processes. "
            "mooncake: Mooncake Transfer Engine over TCP, one batched write per 4 MiB step"
            + (f" (not run: {MOONCAKE_MISSING})." if MOONCAKE_MISSING else ".")
        ),
        md_table(["transfer", "bytes", "memcpy", "shm", "shm, shuffled ids", "zmq (tcp)",
                  "mooncake (tcp)", "mooncake, shuffled ids", "raw TCP"], bandwidth),
        "\n".join(f"- {v}" for v in verdicts),
    ])


def overlap_section(overlap: list[list[str]], overlap_setup: str) -> str:
    return "\n\n".join([
        "## Transfer hidden behind chunked prefill",
        overlap_setup + " Transfer = wall time outside forward passes; hidden = 1 - "
        "overlapped transfer / synchronous transfer. The last chunk's blocks are written after "
        "the last forward, so nothing can hide them: `hidden, earlier chunks` leaves the last "
        "chunk's synchronous write time out of both sides. `forward slowdown` is how much "
        "longer the forward passes took while overlapped copies ran (they share the cores).",
        md_table(["transport", "compute only (s)", "sync (s)", "sync transfer (ms)",
                  "overlapped (s)", "exposed transfer (ms)", "hidden", "hidden, earlier chunks",
                  "forward slowdown"], overlap),
    ])


def layer_stream_section(rows: list[list[str]], setup: str) -> str:
    return "\n\n".join([
        LAYER_STREAM_HEADING,
        setup,
        md_table(["transport", "prompt tokens", "KV",
                  "last layer -> commit, after the forward (ms)", "by layer group (ms)", "ratio",
                  "step start -> commit, after the forward (ms)", "by layer group (ms)",
                  "early writes"], rows),
    ])


if __name__ == "__main__":
    main()
