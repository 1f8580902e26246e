"""`--reasoning-parser` through the router (router/api/responses.py) against a scripted node
whose reply thinks first: `reasoning_content` apart from `content`, in one message and as
stream deltas, the same split either way; `include_reasoning: false` drops it; without the
option the text is all content."""

from __future__ import annotations

import pytest

from tests.router.test_streaming import MODEL, run_with_node, sse_payloads

THINKING = "<think>Two and two.</think>\n\nFour."


def chat(tmp_path, tokenizer, stream: bool, reply: str = THINKING, **fields):
    """The chat answer (the parsed body, or the stream's chunks) to one request."""

    async def scenario(http, node):
        node.reply_text = reply
        body = {"model": MODEL, "messages": [{"role": "user", "content": "2+2?"}],
                "max_tokens": 64, "stream": stream, **fields}
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return sse_payloads(response.text) if stream else response.json()

    settings = fields.pop("settings", {"reasoning_parser": "deepseek_r1"})
    return run_with_node(tmp_path, tokenizer, scenario, **settings)


def streamed(chunks, key: str) -> str:
    return "".join(
        c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"]
    )


@pytest.mark.parametrize("style", ["deepseek_r1", "qwen3"])
def test_a_whole_answer_has_its_thinking_apart(tmp_path, tokenizer, style):
    body = chat(tmp_path, tokenizer, False, settings={"reasoning_parser": style})
    message = body["choices"][0]["message"]
    assert message["reasoning_content"].strip() == "Two and two."
    assert message["content"].strip() == "Four."


def test_a_stream_gives_the_same_split_as_its_own_deltas(tmp_path, tokenizer):
    chunks = chat(tmp_path, tokenizer, True)
    assert streamed(chunks, "reasoning_content").strip() == "Two and two."
    assert streamed(chunks, "content").strip() == "Four."
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any("think>" in (d.get("content") or "") + (d.get("reasoning_content") or "")
                   for d in deltas)
    assert all(not ("reasoning_content" in d and d.get("content")) for d in deltas)


def test_include_reasoning_false_leaves_the_answer_only(tmp_path, tokenizer):
    message = chat(tmp_path, tokenizer, False, include_reasoning=False)["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"].strip() == "Four."
    chunks = chat(tmp_path, tokenizer, True, include_reasoning=False)
    assert streamed(chunks, "reasoning_content") == ""
    assert streamed(chunks, "content").strip() == "Four."


def test_without_a_parser_or_without_thinking_the_text_is_all_content(tmp_path, tokenizer):
    message = chat(tmp_path, tokenizer, False, settings={})["choices"][0]["message"]
    assert "reasoning_content" not in message and "<think>" in message["content"]
    qwen3 = {"reasoning_parser": "qwen3"}
    message = chat(tmp_path, tokenizer, False, "Just four.", settings=qwen3)["choices"][0]
    assert message["message"]["content"].strip() == "Just four."
    assert message["message"]["reasoning_content"] is None
