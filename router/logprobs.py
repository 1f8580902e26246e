"""Formats the node's logprob entries (`[token_id, logprob, [[id, logprob], ...]]` per token)
as the completions API (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat
API (`content: [{token, logprob, bytes, top_logprobs}]`) expect."""

from __future__ import annotations

from typing import Any


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def token(self, token_id: int) -> str:
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
