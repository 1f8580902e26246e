"""The token ids the serving benchmark builds prompts from.

`--tokenizer DIR`: every id of that model folder's tokenizer except its special and added
tokens (the tokenizer also turns prompts into text for `--endpoint chat`). `--vocab-size N`,
for a server whose tokenizer is not at hand: ids from max(16, N/100) to N - N/100 - 1, which
keeps clear of the special tokens that tokenizers put at either end of their vocabulary.
Neither: pdserve's default model's tokenizer, when that model is already downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Vocabulary:
    ids: list[int]
    source: str
    tokenizer: Any = None

    def text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError(
                "--endpoint chat sends text and needs a tokenizer to write it: pass --tokenizer "
                f"DIR (the vocabulary now comes from {self.source})"
            )
        return self.tokenizer.decode(ids)


def range_vocabulary(vocab_size: int) -> Vocabulary:
    if vocab_size < 64:
        raise ValueError(f"--vocab-size is {vocab_size}; expected at least 64")
    edge = max(16, vocab_size // 100)
    return Vocabulary(list(range(edge, vocab_size - edge)), f"ids {edge}..{vocab_size - edge - 1}")


def tokenizer_vocabulary(folder: str | Path) -> Vocabulary:
    from pdserve.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(Path(folder))
    special = tokenizer.added_token_ids
    ids = [t for t in range(len(tokenizer)) if t not in special]
    return Vocabulary(ids, f"the tokenizer in {Path(folder).name}", tokenizer)


def load_vocabulary(tokenizer: str | None, vocab_size: int | None) -> Vocabulary:
    if tokenizer is not None and vocab_size is not None:
        raise ValueError("pass --tokenizer or --vocab-size, not both")
    if vocab_size is not None:
        return range_vocabulary(vocab_size)
    if tokenizer is not None:
        return tokenizer_vocabulary(tokenizer)
    from pdserve.model_store.default_model import default_model_dir, is_model_folder_complete

    folder = default_model_dir()
    if not is_model_folder_complete(folder):
        raise ValueError(
            "no token vocabulary: pass --tokenizer DIR (a model folder) or --vocab-size N "
            "(or run `pdserve download` to use the default model's tokenizer)"
        )
    return tokenizer_vocabulary(folder)
