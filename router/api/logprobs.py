"""Formats the node's logprob entries (`[token_id, logprob, [[id, logprob], ...]]` per token)
as the completions API (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat
API (`content: [{token, logprob, bytes, top_logprobs}]`) expect.

A prompt's scores (`[token_id, logprob, rank, [[id, logprob], ...]]` per prompt token after the
first, TokenUpdate.prompt_logprobs) are checked against the prompt before anything reads them,
then formatted two ways: as an echoed prompt's completions logprobs (`echoed_prompt`: the first
token's entries null, each other one's `top_logprobs` cut to the request's `logprobs`), and in
vLLM's `prompt_logprobs` shape (`prompt_logprobs`: None for the first token, then per token
{str(token_id): {"logprob", "rank", "decoded_token"}}, the prompt's token first, then the
alternatives, each once). Log-probabilities below -9999 (as -inf) are sent as -9999.0, as vLLM
does, since JSON has no infinity.

With vLLM's `return_tokens_as_token_ids` a request gets its tokens named `token_id:N` instead
of their text (`as_token_ids()`), wherever a token is named: so a client can tell tokens whose
text is not valid UTF-8 on its own apart."""

from __future__ import annotations

import math
from typing import Any

from pdserve.wire.limits import MAX_LOGPROBS

LOWEST_LOGPROB = -9999.0


class LogprobFormatter:
    def __init__(self, tokenizer: Any, token_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._token_ids = token_ids

    def as_token_ids(self) -> LogprobFormatter:
        """This formatter, naming tokens `token_id:N` (return_tokens_as_token_ids)."""
        return LogprobFormatter(self._tokenizer, token_ids=True)

    def token(self, token_id: int) -> str:
        if self._token_ids:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, entries: list[list[Any]], offset: int) -> dict[str, Any]:
        """`offset`: length of the choice's text before these tokens."""
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token_id, logprob, top in entries:
            text = self.token(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append({self.token(i): lp for i, lp in top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def echoed_prompt(
        self, prompt: list[int], entries: list[list[Any]] | None, num_top: int
    ) -> dict[str, Any]:
        """The completions logprobs of an echoed prompt, from text offset 0. `entries` are the
        checked scores (None: the node sent none; every entry is then null)."""
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        offset = 0
        for position, token_id in enumerate(prompt):
            entry = entries[position - 1] if entries is not None and position > 0 else None
            text = self.token(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(entry[1]))
            out["top_logprobs"].append(
                {self.token(i): _finite(lp) for i, lp in entry[3][:num_top]}
            )
        return out

    def prompt_logprobs(
        self, prompt: list[int], entries: list[list[Any]]
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs` of a prompt from its checked scores."""
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for token_id, logprob, rank, top in entries:
            position = {str(token_id): self._ranked(token_id, logprob, rank)}
            for alternative_rank, (alternative, alternative_logprob) in enumerate(top, 1):
                position.setdefault(
                    str(alternative),
                    self._ranked(alternative, alternative_logprob, alternative_rank),
                )
            out.append(position)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": self.token(token_id)}

    def chat(self, entries: list[list[Any]]) -> dict[str, Any]:
        content = []
        for token_id, logprob, top in entries:
            content.append(
                {
                    **self._chat_token(token_id, logprob),
                    "top_logprobs": [self._chat_token(i, lp) for i, lp in top],
                }
            )
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def merge_completion(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def check_prompt_entries(entries: Any, prompt: list[int]) -> bool:
    """Whether a node's prompt scores fit `prompt`: one well-formed entry per token after the
    first, each naming that token, with a number for its logprob, a positive rank and at most
    MAX_LOGPROBS [id, logprob] alternatives."""
    if not isinstance(entries, list) or len(entries) != len(prompt) - 1:
        return False
    for position, entry in enumerate(entries, 1):
        if not (isinstance(entry, list) and len(entry) == 4):
            return False
        token_id, logprob, rank, top = entry
        if token_id != prompt[position] or not _is_logprob(logprob):
            return False
        if type(rank) is not int or rank < 1 or not isinstance(top, list):
            return False
        if len(top) > MAX_LOGPROBS or not all(_is_alternative(t) for t in top):
            return False
    return True


def _is_logprob(value: Any) -> bool:
    return type(value) in (int, float) and not math.isnan(value)


def _is_alternative(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and type(value[0]) is int
        and value[0] >= 0
        and _is_logprob(value[1])
    )
