"""What `pdserve serve` does with each option of `vllm serve` (commands/vllm_serve_flags.py), so
a vLLM user's command line starts unchanged or stops with one line naming the option and why.

Every vLLM spelling is one of:
  implemented  `pdserve serve` has an option of that spelling with vLLM's meaning (the
               generated flags of commands/serve_flags.py); nothing here
  accepted     pdserve always behaves as the option asks (`--enable-chunked-prefill`: it always
               prefills in chunks), or the value given is the one pdserve has
               (`--tool-call-parser hermes`): `NO_OPS`, each with why; any other value is
               refused naming it
  refused      `REFUSED` for the option, else `GROUP_REASONS` for its help group: an error in
               argparse's form, `pdserve serve: error: --enable-lora: ...`
`add_vllm_flags` adds the accepted and refused ones to the parser (hidden from --help;
docs/operations.md has their table, `markdown_table()`, which a test keeps equal; print it with
`python -m pdserve.commands.vllm_flags`).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import dataclass

from pdserve.commands.vllm_serve_flags import VLLM_SERVE_OPTIONS, VLLM_VERSION


@dataclass(frozen=True)
class NoOp:
    why: str
    values: tuple[str, ...] | None = None  # the values accepted; None: a switch, or any value


NO_OPS: dict[str, NoOp] = {
    "--enable-auto-tool-choice": NoOp("tool calls are always on: a request with `tools` may "
                                      "get calls"),
    "--tool-call-parser": NoOp("calls are read as Hermes-style <tool_call> tags", ("hermes",)),
    "--enable-chunked-prefill": NoOp("prompts are always prefilled in chunks of "
                                     "--max-num-batched-tokens"),
    "--enable-prompt-tokens-details": NoOp("`usage.prompt_tokens_details.cached_tokens` is "
                                           "always reported"),
    "--disable-uvicorn-access-log": NoOp("there is no uvicorn access log; the router's own "
                                         "request lines follow --disable-log-requests"),
    "--disable-fastapi-docs": NoOp("the router serves no OpenAPI docs pages"),
    "--max-log-len": NoOp("request log lines never carry prompt text"),
    "--response-role": NoOp("answers are always the assistant's", ("assistant",)),
    "--tokenizer-mode": NoOp("tokenizer.json (the model folder's, or --tokenizer's) is read "
                             "as a fast tokenizer", ("auto", "hf")),
    "--chat-template-content-format": NoOp("message content is rendered as a string",
                                           ("auto", "string")),
    "--scheduling-policy": NoOp("requests are served first come first served (clients set "
                                "`priority` only with --allow-client-priority)", ("fcfs",)),
    "--pipeline-parallel-size": NoOp("one pipeline stage", ("1",)),
    "-pp": NoOp("one pipeline stage", ("1",)),
    "--data-parallel-size": NoOp("replicas are nodes (--prefill/--decode/--colocated)", ("1",)),
    "-dp": NoOp("replicas are nodes (--prefill/--decode/--colocated)", ("1",)),
    "--distributed-executor-backend": NoOp("ranks are processes", ("mp",)),
    "--model-impl": NoOp("pdserve's own model code runs", ("auto",)),
    "--runner": NoOp("models generate text", ("auto", "generate")),
    "--convert": NoOp("models generate text", ("auto", "none")),
    "--use-tqdm-on-load": NoOp("loading shows no progress bar"),
}

REFUSED: dict[str, str] = {
    "--no-enable-auto-tool-choice": "tool calls cannot be switched off (a request without "
    "`tools` gets none)",
    "--no-enable-chunked-prefill": "prompts are always prefilled in chunks",
    "--hf-token": "set HF_TOKEN in the environment for `pdserve download` and Hub ids",
    "--config": "give the options on the command line (a YAML file of them is not read)",
    "--trust-request-chat-template": "a request's own `chat_template` is always refused",
    "--lora-modules": "LoRA adapters are not supported",
    "--enable-force-include-usage": "ask for usage with `stream_options.include_usage`",
    "--return-tokens-as-token-ids": "send `return_tokens_as_token_ids: true` with the request",
    "--kv-transfer-config": "pdserve moves KV itself: --prefill/--decode and --kv-transport",
    "--structured-outputs-config": "structured output always uses llguidance",
    "--reasoning-parser-plugin": "only the built-in parsers (--reasoning-parser)",
    "--tool-parser-plugin": "only the built-in Hermes reader",
    "--ssl-ca-certs": "only --ssl-keyfile and --ssl-certfile",
    "--ssl-cert-reqs": "only --ssl-keyfile and --ssl-certfile",
    "--ssl-ciphers": "only --ssl-keyfile and --ssl-certfile",
    "--enable-ssl-refresh": "only --ssl-keyfile and --ssl-certfile, read at start",
    "--api-server-count": "one router process serves the API",
    "--headless": "each role runs alone with `python -m pdserve.node ROLE` (docs/operations.md)",
    "--device-ids": "give the devices with CUDA_VISIBLE_DEVICES",
    "--cpu-offload-gb": "weights stay on the node's device",
    "--speculative-config": "speculative decoding is not supported",
    "--spec-method": "speculative decoding is not supported",
    "--spec-model": "speculative decoding is not supported",
    "--spec-tokens": "speculative decoding is not supported",
}

GROUP_REASONS: dict[str, str] = {
    "General": "vLLM's server process option has no pdserve equivalent",
    "Frontend": "this API server option of vLLM's is not supported",
    "ModelConfig": "this model option of vLLM's is not supported",
    "LoadConfig": "weights load from the folder's safetensors (--load-format auto|dummy)",
    "AttentionConfig": "pdserve chooses its attention kernels itself",
    "MambaConfig": "Mamba models are not supported",
    "StructuredOutputsConfig": "not supported",
    "ParallelConfig": "parallelism is --tensor-parallel-size and the number of nodes "
    "(--prefill/--decode/--colocated); vLLM's other layouts are not supported",
    "CacheConfig": "this KV cache option of vLLM's is not supported",
    "OffloadConfig": "weights are not offloaded",
    "MultiModalConfig": "pdserve serves text-only models",
    "LoRAConfig": "LoRA adapters are not supported",
    "LoggingConfig": "logging is --log-level and --log-format",
    "ObservabilityConfig": "metrics are /metrics' (docs/operations.md); traces are not exported",
    "SchedulerConfig": "this scheduler option of vLLM's is not supported",
    "CompilationConfig": "pdserve compiles its own paths; CUDA graphs are --enforce-eager's",
    "KernelConfig": "pdserve chooses its kernels itself",
    "VllmConfig": "this vLLM configuration object is not supported",
}


@dataclass(frozen=True)
class VllmOption:
    group: str
    spelling: str
    primary: str  # the option's first spelling (a short form's long one)
    takes_value: bool


def vllm_spellings() -> list[VllmOption]:
    return [
        VllmOption(group, spelling, spellings[0], takes_value)
        for group, spellings, takes_value in VLLM_SERVE_OPTIONS
        for spelling in spellings
    ]


def _refusal(option: VllmOption) -> str:
    """Why: the spelling's own reason, a short form's its long form's, else its group's."""
    if option.spelling in REFUSED:
        return REFUSED[option.spelling]
    if not option.spelling.startswith("--") and option.primary in REFUSED:
        return REFUSED[option.primary]
    return GROUP_REASONS[option.group]


class _Accepted(argparse.Action):
    def __init__(self, option_strings, dest, no_op: NoOp, **kwargs) -> None:
        self.no_op = no_op
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        allowed = self.no_op.values
        if allowed is not None and values not in allowed:
            parser.error(
                f"{option_string} {values}: only {' or '.join(allowed)} ({self.no_op.why})"
            )
        namespace.vllm_no_ops = [*getattr(namespace, "vllm_no_ops", []), option_string]


class _Refused(argparse.Action):
    def __init__(self, option_strings, dest, why: str, **kwargs) -> None:
        self.why = why
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} (vLLM's) is not supported: {self.why}")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Every vLLM spelling `parser` does not already have, accepted or refused (module
    docstring); hidden from --help. Accepted ones given are listed in `args.vllm_no_ops`
(absent when none was)."""
    known = set(parser._option_string_actions)  # argparse keeps no public map
    for option in vllm_spellings():
        if option.spelling in known:
            continue
        nargs = None if option.takes_value else 0
        no_op = NO_OPS.get(option.spelling)
        if no_op is not None:
            parser.add_argument(option.spelling, action=_Accepted, no_op=no_op, nargs=nargs,
                                dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(option.spelling, action=_Refused, why=_refusal(option),
                                nargs="?" if option.takes_value else 0,
                                dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)


def implemented(parser: argparse.ArgumentParser) -> set[str]:
    """The spellings `parser` has of its own (not added by `add_vllm_flags`)."""
    return {
        spelling
        for spelling, action in parser._option_string_actions.items()
        if not isinstance(action, _Accepted | _Refused)
    }


def markdown_table(known: Collection[str]) -> str:
    """docs/operations.md's table of vLLM's options: each spelling pdserve does not implement
    (`known`: those it does), accepted or refused, and why."""
    lines = [
        f"| `vllm serve` {VLLM_VERSION} option | here | why |",
        "|---|---|---|",
    ]
    for option in vllm_spellings():
        if option.spelling in known:
            continue
        no_op = NO_OPS.get(option.spelling)
        if no_op is not None:
            values = f" ({' or '.join(no_op.values)})" if no_op.values else ""
            lines.append(f"| `{option.spelling}`{values} | accepted | {no_op.why} |")
        else:
            lines.append(f"| `{option.spelling}` | refused | {_refusal(option)} |")
    return "\n".join(lines)


if __name__ == "__main__":  # this file runs as __main__: its classes are the module's below
    from pdserve.commands import vllm_flags
    from pdserve.commands.cli import serve_parser

    print(vllm_flags.markdown_table(vllm_flags.implemented(serve_parser())))
