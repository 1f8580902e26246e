"""pdserve.text.tokenizer reads a model folder's tokenizer without transformers and gives what
transformers' AutoTokenizer gives for the same folder: token ids (with and without special
tokens, BOS/EOS added by tokenizer.json's post-processor), decoded text, token strings, the
chat template's output; and templates run in a sandbox with Hugging Face's environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from pdserve.text.chat_template import ChatTemplateError
from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.text.tokenizer import load_tokenizer
from tests.text.test_detokenizer import byte_level_tokenizer, metaspace_tokenizer

TEXTS = [
    "Hello world, the café is naïve.",
    " leading and  double  spaces ",
    "日本語のテキスト 😀🎉 résumé",
    "<s>special</s> inside <tool> text",
    "",
    "line\nbreaks\tand tabs",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{% continue %}{% endif %}"
    "{{ bos_token }}{{ message['role'] }}: {{ message['content'] | trim }}\n"
    "{% if message['content'] == 'stop' %}{% break %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ {'role': 'assistant', 'é': 1} | tojson }}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "tool", "content": "skipped"},
    {"role": "user", "content": "Qu'est-ce que c'est ? 日本語"},
]


def save_folder(tokenizer, folder: Path, **config) -> Path:
    """The tokenizer saved as a model folder, with `config` written into its
    tokenizer_config.json."""
    tokenizer.save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def with_bos_eos(tokenizer, eos: bool):
    """The tokenizer with a post-processor that adds <s> (id 1), and </s> (id 2) if `eos`."""
    single = "<s> $A </s>" if eos else "<s> $A"
    special = [("<s>", 1), ("</s>", 2)] if eos else [("<s>", 1)]
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=special
    )
    return tokenizer


FOLDERS = {
    "byte_level": (byte_level_tokenizer, {"chat_template": CHAT_TEMPLATE}),
    "llama_bos": (
        lambda: with_bos_eos(metaspace_tokenizer(llama_decoder=True), eos=False),
        {"chat_template": CHAT_TEMPLATE},
    ),
    "metaspace_bos_eos": (
        lambda: with_bos_eos(metaspace_tokenizer(llama_decoder=False), eos=True),
        {"add_bos_token": False},  # transformers 5 keeps the post-processor regardless
    ),
}


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def pair(request, tmp_path_factory):
    """(ours, transformers') for one model folder."""
    build, config = FOLDERS[request.param]
    folder = save_folder(build(), tmp_path_factory.mktemp(request.param), **config)
    return load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)


def test_encode_equals_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        plain = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == plain, text


def test_bos_and_eos_come_from_the_post_processor(tmp_path):
    folder = save_folder(with_bos_eos(metaspace_tokenizer(llama_decoder=True), True), tmp_path)
    ids = load_tokenizer(folder).encode("hello")
    assert ids[0] == 1 and ids[-1] == 2  # <s> ... </s>
    assert load_tokenizer(folder).encode("hello", add_special_tokens=False) == ids[1:-1]


def test_decode_and_token_strings_equal_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        ids = theirs.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            ), (text, skip)
        assert [ours.convert_ids_to_tokens(i) for i in ids] == theirs.convert_ids_to_tokens(ids)
    assert ours.eos_token_id == theirs.eos_token_id
    assert len(ours) == len(theirs)


def test_streamed_text_equals_transformers_streamed_text(pair):
    ours, theirs = pair
    ids = [i for text in TEXTS for i in theirs.encode(text, add_special_tokens=False)]

    def stream(tokenizer) -> str:
        detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
        return "".join(detokenizer.add([token]) for token in ids) + detokenizer.flush()

    assert stream(ours) == stream(theirs) == theirs.decode(ids, skip_special_tokens=True)


def test_chat_template_equals_transformers(pair):
    ours, theirs = pair
    if not theirs.chat_template:
        with pytest.raises(ValueError, match="no chat template"):
            ours.apply_chat_template(MESSAGES)
        return
    text = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert '{"role": "assistant", "é": 1}' in text and "skipped" not in text
    assert ours.apply_chat_template(MESSAGES) == theirs.encode(text, add_special_tokens=False)


def test_chat_template_from_its_own_file_wins(tmp_path):
    folder = save_folder(byte_level_tokenizer(), tmp_path, chat_template="{{ 'config' }}")
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    ours = load_tokenizer(folder)
    assert ours.decode(ours.apply_chat_template([{"role": "user", "content": "hi"}])) == "hi!"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{{ ''.__class__.__mro__ }}", "chat template failed"),
        ("{{ messages.append(1) }}", "chat template failed"),
        ("{% for %}", "does not parse"),
    ],
    ids=["raise_exception", "dunder", "mutation", "syntax"],
)
def test_templates_run_sandboxed_and_fail_as_value_errors(tmp_path, template, message):
    folder = save_folder(byte_level_tokenizer(), tmp_path)
    (folder / "chat_template.jinja").write_text(template)
    with pytest.raises(ChatTemplateError, match=message):
        load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_folder_without_tokenizer_json_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.mark.default_model
def test_default_model_tokenizer_equals_transformers(default_model_dir):
    ours, theirs = load_tokenizer(default_model_dir), AutoTokenizer.from_pretrained(default_model_dir)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    text = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(MESSAGES) == theirs.encode(text, add_special_tokens=False)
