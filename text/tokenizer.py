"""A model folder's tokenizer, read with the `tokenizers` library (no transformers, no torch).

`load_tokenizer(folder)` reads `tokenizer.json` (the fast tokenizer every Hugging Face model
ships; its post-processor adds BOS/EOS), the special tokens and `clean_up_tokenization_spaces`
from `tokenizer_config.json`, and the chat template from `chat_template.jinja` or
`tokenizer_config.json`. Like transformers 5, it does not rebuild the post-processor from
`add_bos_token`/`add_eos_token`. Encoding, decoding and the chat template give what transformers'
`AutoTokenizer` gives for the same folder (tests/text compares them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as Backend

from pdserve.text.chat_template import TemplateOptions, compile_template, render_chat

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken map."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_source(folder: Path, config: dict) -> str | None:
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    """Text <-> token ids for one model, and its chat template.

    The method names are transformers' (`encode`, `decode`, `convert_ids_to_tokens`,
    `apply_chat_template`), so code written against a Hugging Face tokenizer reads the same.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: dict[str, str],
        chat_template: str | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend_tokenizer = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = (
            compile_template(chat_template) if chat_template else None
        )
        # As transformers: the clean-up was made for WordPiece and would corrupt BPE text.
        model = json.loads(backend.to_str()).get("model") or {}
        self._clean_up = clean_up_tokenization_spaces and model.get("type") != "BPE"
        eos = special_tokens.get("eos_token")
        self.eos_token_id: int | None = backend.token_to_id(eos) if eos else None

    @classmethod
    def from_folder(cls, folder: Path, chat_template: str | None = None) -> Tokenizer:
        """`chat_template` (a template's source) replaces the folder's."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder} has no tokenizer.json; pdserve reads the fast tokenizer file that "
                "Hugging Face models ship (convert a sentencepiece-only folder with "
                "transformers' AutoTokenizer(...).save_pretrained first)"
            )
        backend = Backend.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        special_tokens = {
            key: text for key in SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key)))
        }
        return cls(
            backend,
            special_tokens=special_tokens,
            chat_template=chat_template or _chat_template_source(folder, config),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    def __len__(self) -> int:
        """The vocabulary's size with the added tokens."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def added_token_ids(self) -> set[int]:
        """Ids of the tokens added on top of the vocabulary (special or not)."""
        return set(self.backend_tokenizer.get_added_tokens_decoder())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        options: TemplateOptions | None = None,
    ) -> list[int]:
        """Token ids of the conversation, by default followed by the assistant's turn header
        (`options`: text/chat_template.py); `tools` (OpenAI's function maps) go to the
        template's `tools` variable."""
        if self._compiled_template is None:
            raise ValueError("the model has no chat template; use a plain prompt instead")
        text = render_chat(
            self._compiled_template, messages, self.special_tokens, tools, options
        )
        return self.encode(text, add_special_tokens=False)

    def template_reads(self, variable: str) -> bool:
        """Whether the chat template's source names `variable` (`tools`, `tool_calls`): a
        template that never names `tools` shows the model no tools however they are passed."""
        return self.chat_template is not None and variable in self.chat_template


def load_tokenizer(model_path: Path, chat_template: str | None = None) -> Tokenizer:
    return Tokenizer.from_folder(Path(model_path), chat_template)


def read_chat_template(value: str) -> str:
    """A chat template given as vLLM's `--chat-template` takes it: the path of a file holding
    one, or the template itself. ValueError for a value that is neither, or a template that
    does not parse."""
    try:
        source = Path(value).expanduser().read_text(encoding="utf-8")
    except (OSError, ValueError):  # no such file, or a name no file can have: a template?
        if "{{" not in value and "{%" not in value:
            raise ValueError(
                f"--chat-template {value!r} is neither a file nor a Jinja template"
            ) from None
        source = value
    compile_template(source)  # ChatTemplateError (a ValueError) if it does not parse
    return source
