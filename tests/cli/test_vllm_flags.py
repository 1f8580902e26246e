"""vLLM's command lines through `pdserve serve`'s parser (commands/vllm_flags.py): every option
of `vllm serve` is implemented, accepted, or refused with one line naming it and why; real
command lines from vLLM's docs and examples start or stop by name; the docs' table is the
module's."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from pdserve.commands.cli import main, serve_parser
from pdserve.commands.serve_flags import check_serve_flags
from pdserve.commands.vllm_flags import (
    GROUP_REASONS,
    NO_OPS,
    REFUSED,
    implemented,
    markdown_table,
    vllm_spellings,
)
from pdserve.commands.vllm_serve_flags import VLLM_SERVE_OPTIONS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
PARSER = serve_parser()
KNOWN = implemented(PARSER)
SPELLINGS = {option.spelling for option in vllm_spellings()}


def outcome(flags: list[str], capsys) -> str:
    """"start" when the line parses and passes serve's checks, else argparse's error line."""
    try:
        check_serve_flags(PARSER.parse_args(flags))
    except SystemExit:
        return capsys.readouterr().err.strip().splitlines()[-1]
    except ValueError as error:  # what `pdserve serve` prints with its usage
        return f"pdserve serve: error: {error}"
    return "start"


@pytest.mark.parametrize("option", vllm_spellings(), ids=lambda o: o.spelling)
def test_every_vllm_option_is_implemented_accepted_or_refused_by_name(option, capsys):
    no_op = NO_OPS.get(option.spelling)
    value = [no_op.values[0] if no_op and no_op.values else "1"] if option.takes_value else []
    said = outcome([option.spelling, *value], capsys)
    if option.spelling in KNOWN:
        assert said == "start" or option.spelling in said or "MODEL" in said, said
    elif no_op is not None:
        assert said == "start", said
    else:
        assert said.startswith(f"pdserve serve: error: {option.spelling} (vLLM's) is not "
                               "supported: "), said


def test_the_tables_name_only_vllm_options_pdserve_does_not_implement():
    assert set(NO_OPS) <= SPELLINGS and set(REFUSED) <= SPELLINGS
    assert not (set(NO_OPS) | set(REFUSED)) & KNOWN
    assert not set(NO_OPS) & set(REFUSED)
    assert {group for group, _, _ in VLLM_SERVE_OPTIONS} == set(GROUP_REASONS)


# Command lines as vLLM's documentation and examples give them (model ids shortened to one).
COMMAND_LINES = [
    ("Qwen/Qwen3-8B --enable-auto-tool-choice --tool-call-parser hermes", "start"),
    ("Qwen/Qwen3-8B --reasoning-parser qwen3", "start"),
    ("Qwen/Qwen3-8B --enable-reasoning --reasoning-parser deepseek_r1", "--enable-reasoning"),
    ("Qwen/Qwen2.5-1.5B-Instruct --dtype auto --api-key token-abc123", "start"),
    (("Qwen/Qwen2.5-1.5B-Instruct --max-model-len 4096 --gpu-memory-utilization 0.9 "
     "--enable-chunked-prefill --max-num-batched-tokens 2048"), "start"),
    ("Qwen/Qwen2.5-1.5B-Instruct --tensor-parallel-size 1 --pipeline-parallel-size 1", "start"),
    ("Qwen/Qwen2.5-1.5B-Instruct --pipeline-parallel-size 2", "--pipeline-parallel-size 2"),
    (("Qwen/Qwen2.5-1.5B-Instruct --served-model-name my-model --enable-prefix-caching "
     "--seed 0"), "start"),
    ("Qwen/Qwen2.5-1.5B-Instruct --kv-cache-dtype fp8 --max-num-seqs 64", "start"),
    ("Qwen/Qwen2.5-1.5B-Instruct --generation-config vllm --chat-template ./t.jinja", "start"),
    ("Qwen/Qwen2.5-1.5B-Instruct --trust-remote-code --disable-log-stats", "start"),
    ("Qwen/Qwen2.5-7B-Instruct-AWQ --quantization awq", "--quantization"),
    ("meta-llama/Llama-3.2-3B-Instruct --enable-lora --lora-modules sql=/loras/sql",
     "--enable-lora"),
    (("meta-llama/Llama-3.1-8B-Instruct --speculative-config "
     "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'"), "--speculative-config"),
    ("Qwen/Qwen2.5-VL-3B-Instruct --limit-mm-per-prompt '{\"image\": 2}'",
     "--limit-mm-per-prompt"),
    ("Qwen/Qwen2.5-1.5B-Instruct --tool-call-parser mistral", "--tool-call-parser mistral"),
    ("Qwen/Qwen2.5-1.5B-Instruct --distributed-executor-backend ray",
     "--distributed-executor-backend ray"),
    ("Qwen/Qwen2.5-1.5B-Instruct --kv-cache-memory-bytes 268435456", "start"),
]


@pytest.mark.parametrize(("line", "expected"), COMMAND_LINES)
def test_real_vllm_command_lines_start_or_stop_naming_the_option(line, expected, capsys):
    said = outcome(shlex.split(line), capsys)
    if expected == "start":
        assert said == "start", said
    else:
        assert said.startswith("pdserve serve: error: ") and expected in said, said


def test_an_accepted_option_says_so_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr("pdserve.commands.launcher.serve", lambda args: 0)
    assert main(["serve", "--enable-chunked-prefill", "--tool-call-parser", "hermes"]) == 0
    err = capsys.readouterr().err
    assert "--enable-chunked-prefill (vLLM's) accepted: prompts are always prefilled" in err
    assert "--tool-call-parser (vLLM's) accepted: calls are read as Hermes-style" in err


def test_the_docs_table_is_the_modules():
    assert markdown_table(sorted(KNOWN)) in DOCS.read_text()
