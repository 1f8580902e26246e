"""`--reasoning-parser` (text/reasoning_split.py): a choice's text split into reasoning
and content, the same whether it comes whole or one character at a time."""

from __future__ import annotations

import pytest

from pdserve.text.reasoning_split import (
    ReasoningStyle,
    ThinkingSplitter,
    split_whole,
)

QWEN3, R1 = ReasoningStyle.QWEN3, ReasoningStyle.DEEPSEEK_R1
CASES = [
    # style, text, reasoning, content
    (QWEN3, "<think>\nPlan it.\n</think>\n\nThe answer.", "\nPlan it.\n", "The answer."),
    (QWEN3, "  <think>a < b</think>c", "a < b", "c"),
    (QWEN3, "No thinking here.", "", "No thinking here."),
    (QWEN3, "<thin", "", "<thin"),  # ended before it could be a tag
    (QWEN3, "<think>cut short by max_tokens </thi", "cut short by max_tokens </thi", ""),
    (QWEN3, "", "", ""),
    (R1, "Plan it.</think>\n\nThe answer.", "Plan it.", "The answer."),
    (R1, "<think>Plan it.</think>Done", "Plan it.", "Done"),
    (R1, "Still thinking when cut", "Still thinking when cut", ""),
    (R1, "a</think>b</think>c", "a", "b</think>c"),  # only the first end tag counts
]


@pytest.mark.parametrize(("style", "text", "reasoning", "content"), CASES)
def test_whole_text_splits_at_the_tags(style, text, reasoning, content):
    split = split_whole(style, text)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize(("style", "text", "reasoning", "content"), CASES)
def test_streamed_character_by_character_gives_the_same_split(style, text, reasoning, content):
    splitter = ThinkingSplitter(style)
    got_reasoning = got_content = ""
    for char in text:
        part = splitter.feed(char)
        got_reasoning += part.reasoning
        got_content += part.content
    last = splitter.feed("", finished=True)
    assert (got_reasoning + last.reasoning, got_content + last.content) == (reasoning, content)


def test_no_tag_fragment_is_ever_given_out_as_reasoning():
    splitter = ThinkingSplitter(R1)
    given = [splitter.feed(piece).reasoning for piece in ("abc</", "thi", "nk>", "answer")]
    assert given == ["abc", "", "", ""]
    assert splitter.feed("", finished=True).content == ""  # "answer" came out already
