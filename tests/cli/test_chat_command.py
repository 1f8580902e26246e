"""`pdserve chat`: each turn goes through the model's chat template with the whole history, is
printed as it streams, and an empty line ends the session."""

from __future__ import annotations

import shutil

from pdserve.commands.cli import main

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_chat_answers_every_turn_through_the_template(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    turns = iter(["hello", "and again", ""])
    prompts = []

    def typed(prompt: str = "") -> str:
        prompts.append(prompt)
        return next(turns)

    monkeypatch.setattr("builtins.input", typed)
    assert main(["chat", "--model", str(folder), "--max-tokens", "4", "--temperature", "0"]) == 0
    answers = capsys.readouterr().out.splitlines()
    assert len(prompts) == 3 and len(answers) == 2
