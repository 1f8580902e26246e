"""A reasoning model's output split into its thinking (between `<think>` and `</think>`) and its
answer, as vLLM's `--reasoning-parser` splits it, whole or as the text streams. The router
answers the parts as `reasoning_content` and `content` (router/api/responses.py;
`--reasoning-parser`, RouterConfig.reasoning_parser).

Styles (the tags are the same, where the thinking starts differs):
  qwen3        the choice thinks only if its output starts with `<think>` (after white
               space); with `chat_template_kwargs: {"enable_thinking": false}` Qwen3's template
               writes an empty thinking block into the prompt, and the output is all content.
  deepseek_r1  the choice starts thinking (its template opens `<think>` in the prompt); a
               leading `<think>` in the output is dropped.
Either way the text up to `</think>` is reasoning and the text after it content; a choice that
ends before `</think>` (cut by max_tokens) has all its text as reasoning. The text right after
`</think>` loses its leading new lines, as the models write "</think>\\n\\n".

Lifecycle of one choice's `ThinkingSplitter`, as its text streams in:
  OPENING   (qwen3 only) the first characters, held until they show whether the output
            starts with `<think>` -> THINKING, or not -> ANSWERING
  THINKING  text is reasoning; a tail that could be the start of `</think>` is held back
            until the next text shows it is not -> ANSWERING at `</think>`
  ANSWERING text is content (its leading new lines dropped)
At the choice's end whatever is held is given out as the stage says.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

START_TAG, END_TAG = "<think>", "</think>"


class ReasoningStyle(enum.StrEnum):
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"


class Stage(enum.Enum):
    OPENING = "opening"
    THINKING = "thinking"
    ANSWERING = "answering"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


def _held_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ThinkingSplitter:
    """One choice's text, split as it streams (module docstring)."""

    def __init__(self, style: ReasoningStyle) -> None:
        self.stage = Stage.OPENING if style is ReasoningStyle.QWEN3 else Stage.THINKING
        self.strip_start = True  # a leading <think> is not reasoning
        self.strip_newlines = False  # the answer's leading new lines are not content
        self.held = ""

    def feed(self, text: str, finished: bool = False) -> Split:
        out = Split()
        self.held += text
        while True:
            if self.stage is Stage.OPENING and not self._open(finished):
                break
            if self.stage is Stage.THINKING and not self._think(out, finished):
                break
            if self.stage is Stage.ANSWERING:
                self._answer(out)
                break
        return out

    def _open(self, finished: bool) -> bool:
        """Whether the stage was decided (qwen3's first characters)."""
        lead = self.held.lstrip()
        if lead.startswith(START_TAG):
            self.held = lead[len(START_TAG):]
            self.stage = Stage.THINKING
            self.strip_start = False
            return True
        if START_TAG.startswith(lead) and not finished:
            return False  # too few characters yet to tell
        self.stage = Stage.ANSWERING
        return True

    def _think(self, out: Split, finished: bool) -> bool:
        """Gives out reasoning; whether the thinking ended."""
        if self.strip_start:
            lead = self.held.lstrip()
            if START_TAG.startswith(lead) and lead != START_TAG and not finished:
                return False  # could still be a leading <think>
            if lead.startswith(START_TAG):
                self.held = lead[len(START_TAG):]
            self.strip_start = False
        end = self.held.find(END_TAG)
        if end >= 0:
            out.reasoning += self.held[:end]
            self.held = self.held[end + len(END_TAG):]
            self.stage = Stage.ANSWERING
            self.strip_newlines = True
            return True
        keep = 0 if finished else _held_tail(self.held, END_TAG)
        out.reasoning += self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return False

    def _answer(self, out: Split) -> None:
        if self.strip_newlines:
            self.held = self.held.lstrip("\n")
            self.strip_newlines = not self.held
        out.content += self.held
        self.held = ""


def split_whole(style: ReasoningStyle, text: str) -> Split:
    """A whole choice's text, split at once."""
    return ThinkingSplitter(style).feed(text, finished=True)
