"""Tensor parallelism against one rank on the same machine: prefill and decode speed.

One engine with `--tensor-parallel-size 1` and one with N (engine/distributed/), each driven
through `LLMEngine.step` on the same token-id workload, greedy, EOS ignored: a prompt of
`--prefill-tokens` computed alone (one output token), then `--decode-tokens` outputs of
batch 1 and of a batch of `--batch` short prompts. Both engines get the same node thread count
(`--threads`, default every usable core), which TP splits between its ranks. Weights are
dummy (random) from a built-in Llama-shaped config unless `--model` names a folder; fp32.

    python -m pdserve.bench.tensor_parallel                    # N = 2, the built-in shape
    python -m pdserve.bench.tensor_parallel --tp 2 --model /path/to/model --output /tmp/tp.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import time
from pathlib import Path

from pdserve.bench.machine import command_line, load_average, machine_info
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu.cpu_features import usable_cores
from pdserve.engine.llm_engine import LLMEngine
from pdserve.wire.sampling_params import SamplingParams

# ~160M parameters: 8 layers of hidden 1024, 16 heads over 8 KV heads, MLP 2816, vocab 32000.
BUILT_IN_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="ranks of the compared engine")
    parser.add_argument("--model", default=None, help="a model folder (default: built-in shape)")
    parser.add_argument("--threads", type=int, default=None, help="node threads (all cores)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output", type=Path, default=None, help="also write the report here")
    return parser.parse_args(argv)


class Workload:
    def __init__(self, engine: LLMEngine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.ids = itertools.count()

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(3, self.engine.model_config.vocab_size) for _ in range(length)]

    def seconds(self, prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True
        )
        started = time.perf_counter()
        for prompt in prompts:
            self.engine.add_request(str(next(self.ids)), prompt, params)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return time.perf_counter() - started


def measure(model: str, tp: int, threads: int, args: argparse.Namespace) -> dict[str, float]:
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            load_format="dummy",
            num_kv_blocks=1024,
            tensor_parallel_size=tp,
            num_threads=threads,
        )
    )
    try:
        work = Workload(engine)
        work.seconds([work.prompt(8)], 2)  # warm-up
        prefill = work.seconds([work.prompt(args.prefill_tokens)], 1)
        decode_1 = work.seconds([work.prompt(8)], args.decode_tokens)
        decode_n = work.seconds([work.prompt(8) for _ in range(args.batch)], args.decode_tokens)
    finally:
        engine.close()
    return {
        "prefill tokens/s": args.prefill_tokens / prefill,
        "decode tokens/s, batch 1": args.decode_tokens / decode_1,
        f"decode tokens/s, batch {args.batch}": args.batch * args.decode_tokens / decode_n,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = args.threads or usable_cores()
    machine = machine_info()  # before TP sets this process's threads to its rank's share
    with tempfile.TemporaryDirectory() as folder:
        model = args.model
        if model is None:
            model = folder
            (Path(folder) / "config.json").write_text(json.dumps(BUILT_IN_CONFIG))
        one = measure(model, 1, threads, args)
        many = measure(model, args.tp, threads, args)
    model_name = args.model or "built-in Llama shape (~160M parameters), dummy weights"
    lines = [
        "# Tensor parallelism vs one rank",
        "",
        f"`{command_line()}`",
        "",
        *(f"- {key}: {value}" for key, value in machine.items()),
        f"- load average at the end: {load_average()}",
        f"- model: {model_name}, fp32, {threads} node threads",
        "",
        f"| | TP 1 | TP {args.tp} | TP {args.tp} / TP 1 |",
        "|---|---|---|---|",
        *(
            f"| {key} | {one[key]:,.1f} | {many[key]:,.1f} | {many[key] / one[key]:.2f} |"
            for key in one
        ),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output is not None:
        args.output.write_text(report)


if __name__ == "__main__":
    main()
