"""How many characters of text one token can stand for, read from a tokenizer's own
description, so the router can refuse a prompt that can never fit the context without
tokenizing it (router/api/routes.py checks it on the event loop; tokenizing runs in a thread)."""

from __future__ import annotations

import json
from typing import Any

_KEEPS_TEXT_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}
)


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, or None when the tokenizer does
    not make that knowable. It does for a BPE model that fuses no run of unknown characters
    into one token, with no normalizer that may shorten the text (NFC merges characters,
    others drop some), no pre-tokenizer that drops characters, and no added token that
    swallows the whitespace next to it: then every token's vocabulary string (byte-level: one
    character per byte) is at least as long as the text it stands for."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 (not a tokenizers.Tokenizer: no bound)
        return None
    model = spec.get("model") or {}
    added = spec.get("added_tokens") or []
    if (
        model.get("type") != "BPE"
        or (model.get("fuse_unk") and not model.get("byte_fallback"))
        or not _keeps_length(spec.get("normalizer"))
        or not _keeps_text(spec.get("pre_tokenizer"))
        or any(token.get("lstrip") or token.get("rstrip") for token in added)
    ):
        return None
    contents = [*(model.get("vocab") or {}), *(token.get("content", "") for token in added)]
    return max(map(len, contents), default=0) or None


def _keeps_length(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(map(_keeps_length, normalizer.get("normalizers", [])))
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        return pattern is not None and len(normalizer.get("content", "")) >= len(pattern)
    return kind == "Prepend"


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(map(_keeps_text, pre_tokenizer.get("pretokenizers", [])))
    return kind in _KEEPS_TEXT_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"
