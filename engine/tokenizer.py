"""Tokenizer and chat template from the model folder (transformers' fast tokenizers)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_path)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of the conversation followed by the assistant's turn header."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template; use a plain prompt instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
