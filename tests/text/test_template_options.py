"""A chat request's template options (text/chat_template.py's `TemplateOptions`) render what
transformers' `apply_chat_template` renders with the same arguments: `add_generation_prompt`
false, `continue_final_message`, and extra template variables (Qwen3's `enable_thinking`)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pdserve.text.chat_template import ChatTemplateError, TemplateOptions
from pdserve.text.tokenizer import load_tokenizer
from tests.text.test_detokenizer import byte_level_tokenizer
from tests.text.test_tokenizer import save_folder

# A Qwen3-style template: turns, a header when asked, an empty thinking block when thinking is
# switched off.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour is "},
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = save_folder(
        byte_level_tokenizer(), tmp_path_factory.mktemp("qwen3ish"), chat_template=TEMPLATE
    )
    return load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize(
    ("options", "theirs_kwargs"),
    [
        (TemplateOptions(), {"add_generation_prompt": True}),
        (TemplateOptions(add_generation_prompt=False), {"add_generation_prompt": False}),
        (
            TemplateOptions(kwargs={"enable_thinking": False}),
            {"add_generation_prompt": True, "enable_thinking": False},
        ),
        (
            TemplateOptions(add_generation_prompt=False, continue_final_message=True),
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
    ],
    ids=["default", "no-generation-prompt", "enable-thinking-false", "continue-final-message"],
)
def test_options_render_as_transformers_renders_them(pair, options, theirs_kwargs):
    ours, theirs = pair
    text = theirs.apply_chat_template(CONVERSATION, tokenize=False, **theirs_kwargs)
    assert ours.decode(ours.apply_chat_template(CONVERSATION, options=options)) == text


def test_a_continued_message_ends_inside_its_text(pair):
    ours, _ = pair
    options = TemplateOptions(add_generation_prompt=False, continue_final_message=True)
    text = ours.decode(ours.apply_chat_template(CONVERSATION, options=options))
    assert text.endswith("<|im_start|>assistant\nThe colour is ")  # no <|im_end|>
    thinking = TemplateOptions(kwargs={"enable_thinking": False})
    assert ours.decode(ours.apply_chat_template(CONVERSATION, options=thinking)).endswith(
        "<think>\n\n</think>\n\n"
    )


def test_a_last_message_without_text_cannot_be_continued(pair):
    ours, _ = pair
    options = TemplateOptions(add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="needs a last message with text"):
        ours.apply_chat_template([{"role": "user", "content": "  "}], options=options)
