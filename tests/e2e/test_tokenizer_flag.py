"""End to end: `pdserve serve --tokenizer FOLDER` (vLLM's flag) serves the weights of MODEL with
another folder's tokenizer files. The tiny model's own folder has the byte tokenizer and its
`<s>role: ` chat template; the second folder's tokenizer makes `<extra_300>` one special token
and has a bracketed template, so /tokenize and a chat request's prompt token count tell which
tokenizer the router and the node read. A `--tokenizer` that is missing or unreadable stops
`pdserve serve` before anything starts, with one line naming the flag."""

from __future__ import annotations

import subprocess

import httpx
import openai
import pytest

from pdserve.commands.serve_process import ServeProcess
from pdserve.testing.tiny_models import byte_tokenizer, save_tiny_model
from pdserve.text.tokenizer import load_tokenizer
from pdserve.wire.child_command import python_module_command

SPECIAL = "<extra_300>"
BRACKETED_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}]{% endfor %}"
    "{% if add_generation_prompt %}[assistant|{% endif %}"
)
MESSAGES = [{"role": "user", "content": f"Say {SPECIAL} twice."}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the model's folder, the other tokenizer's folder)."""
    model = save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-own-tokenizer"))
    other = byte_tokenizer()
    other.add_special_tokens({"additional_special_tokens": [SPECIAL]})  # id 300, in the vocab
    other.chat_template = BRACKETED_TEMPLATE
    tokenizer = tmp_path_factory.mktemp("other-tokenizer")
    other.save_pretrained(tokenizer)
    return model, tokenizer


@pytest.fixture(scope="module")
def server(folders):
    model, tokenizer = folders
    served = ServeProcess(
        ["--model", str(model), "--tokenizer", str(tokenizer), "--colocated", "--dtype",
         "float32"], ready_timeout_s=240,
    )
    try:
        yield served.url
    finally:
        served.close()


def tokenize(url: str, **body) -> list[int]:
    answer = httpx.post(f"{url}/tokenize", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def test_the_router_tokenizes_with_the_other_folders_tokenizer(server, folders):
    model, tokenizer = folders
    own, other = load_tokenizer(model), load_tokenizer(tokenizer)
    assert own.encode(SPECIAL) != other.encode(SPECIAL) == [300]
    assert tokenize(server, prompt=SPECIAL) == [300]
    chat_ids = other.apply_chat_template(MESSAGES)
    assert chat_ids != own.apply_chat_template(MESSAGES)
    assert tokenize(server, messages=MESSAGES) == chat_ids


def test_a_chat_prompt_is_counted_with_the_other_folders_template(server, folders):
    _, tokenizer = folders
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=2, temperature=0,
    )
    assert answer.usage.prompt_tokens == len(load_tokenizer(tokenizer).apply_chat_template(MESSAGES))
    assert answer.usage.completion_tokens == 2


@pytest.mark.parametrize("missing", ["folder", "tokenizer.json"])
def test_a_missing_tokenizer_stops_the_start_with_one_line_naming_the_flag(
    folders, tmp_path, missing
):
    model, _ = folders
    tokenizer = tmp_path / "no-such-folder" if missing == "folder" else tmp_path
    start = subprocess.run(
        [*python_module_command("pdserve.commands.cli"), "serve", "--model", str(model),
         "--tokenizer", str(tokenizer), "--colocated"],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert start.returncode == 2
    [line] = start.stderr.strip().splitlines()
    assert line.startswith(f"pdserve: --tokenizer {tokenizer}: ")
    assert missing in line
