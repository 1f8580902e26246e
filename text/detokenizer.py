"""Streaming text output: incremental detokenization and stop-string matching.

`IncrementalDetokenizer` turns generated token ids into text deltas without re-decoding the
whole sequence; `StopStringMatcher` then cuts the delta stream at the first stop string.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.text.tokenizer import Tokenizer

# What a byte-level or byte-fallback decoder yields for an incomplete UTF-8 sequence.
_REPLACEMENT_CHAR = "\ufffd"
# A SentencePiece byte-fallback token, e.g. "<0xE2>".
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDetokenizer:
    """Decodes a stream of generated token ids into text deltas.

    Each `add` decodes only a small window: the tokens behind the last emitted text (the prefix,
    so that decoders that treat the first token specially, like SentencePiece's leading space,
    see the same context as a full decode) plus the tokens not emitted yet. The delta is the
    window's text minus the prefix's text. Text that may still change is held back: text ending
    in U+FFFD (usually a multi-byte character split across byte-level tokens) and text ending
    in a run of byte-fallback tokens such as <0xE2>. A later token completes it, or `flush`
    releases it. Work per call is proportional to the tokens since the last emission plus the
    prefix, i.e. O(1) amortized per token; only a long undecodable or byte-token run grows it.

    The concatenated deltas (with `flush`) equal
    `tokenizer.decode(generated_ids, skip_special_tokens=...)`. The prompt is deliberately not
    used as decoding context, since it would change that text (e.g. keep the leading space of
    the first generated SentencePiece token, which a decode of the generated ids strips).
    Limit: `clean_up_tokenization_spaces`, if the tokenizer enables it, applies per window.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        """`prompt_token_ids` are accepted for the request's sake; see the class docstring."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # end of the tokens whose text has been emitted
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends newly generated ids; returns the text that became final (may be "")."""
        self._ids.extend(token_ids)
        window = self._decode(self._prefix_offset, len(self._ids))
        if (
            len(window) <= len(self._prefix_text)
            or window.endswith(_REPLACEMENT_CHAR)
            or self._in_byte_run()
        ):
            return ""
        return self._emit(window)

    def flush(self) -> str:
        """Returns the held-back text (e.g. an invalid trailing byte sequence) at the end."""
        window = self._decode(self._prefix_offset, len(self._ids))
        if len(window) <= len(self._prefix_text):
            return ""
        return self._emit(window)

    def _emit(self, window: str) -> str:
        delta = window[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._pieces.append(delta)
        return delta

    def _in_byte_run(self) -> bool:
        """Whether the pending tokens end in a run of byte-fallback tokens.

        A byte-fallback decoder turns a whole run into U+FFFD if it proves invalid UTF-8, so the
        run's text is final only once a non-byte token ends it. Tokens that decode to nothing
        on their own (e.g. skipped special tokens) are looked through.
        """
        for token_id in reversed(self._ids[self._read_offset :]):
            token = self._tokenizer.convert_ids_to_tokens(token_id)
            if token is not None and _BYTE_TOKEN.fullmatch(token):
                return True
            if self._decode_ids([token_id]):
                return False
        return False

    def _decode(self, start: int, end: int) -> str:
        return self._decode_ids(self._ids[start:end])

    def _decode_ids(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Cuts a stream of text deltas before the first stop string.

    Earliest-occurrence rule: the output is the full text truncated before the stop-string
    occurrence that starts earliest, exactly as if the whole text were searched at once. So a
    complete match is not acted on while an overlapping stop string that starts earlier may
    still complete (with stops "ab" and "xaby", "xab" waits for more text). Text that may be
    the start of a stop string is held back until it is known not to be. Empty stop strings
    are ignored.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = [s for s in stop if s]
        self._max_len = max(map(len, self._stop), default=0)
        self._held = ""
        self._stopped = False

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was matched)."""
        if self._stopped:
            return "", True
        text = self._held + new_text
        match = self._earliest_match(text)
        partial = self._earliest_partial(text)
        if match is not None and match <= partial:
            self._held, self._stopped = "", True
            return text[:match], True
        self._held = text[partial:]
        return text[:partial], False

    def flush(self) -> str:
        """Returns the held-back text when generation ends without a stop (cut at a match)."""
        text, self._held = self._held, ""
        if self._stopped:
            return ""
        match = self._earliest_match(text)
        return text if match is None else text[:match]

    def _earliest_match(self, text: str) -> int | None:
        """Start of the earliest complete stop string in `text`, if any."""
        starts = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(starts, default=None)

    def _earliest_partial(self, text: str) -> int:
        """Start of the longest suffix of `text` that is a proper prefix of a stop string."""
        n = len(text)
        for i in range(max(0, n - self._max_len + 1), n):
            tail = text[i:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stop):
                return i
        return n
