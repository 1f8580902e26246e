"""`pdserve serve --log-format json` (real processes, tiny model): everything the deployment
writes, the launcher's own lines included (commands/operator_lines.py), is one JSON object per
line, from start-up through serving a request to a clean stop."""

from __future__ import annotations

import json

import httpx

from pdserve.commands.operator_lines import OperatorLines
from pdserve.commands.serve_process import ServeProcess


def test_text_lines_stay_as_they_are_and_json_lines_carry_the_message(capsys):
    OperatorLines("text").say("pdserve is serving x")
    OperatorLines("json").warn("pdserve: node decode-0 exited")
    out, err = capsys.readouterr()
    assert out == "pdserve is serving x\n"
    line = json.loads(err)
    assert (line["level"], line["logger"], line["message"]) == (
        "WARNING", "pdserve.launcher", "pdserve: node decode-0 exited"
    )


def test_a_json_deployment_writes_only_json_lines(tiny_llama_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    server = ServeProcess(["--model", str(tiny_llama_dir), "--colocated", "--log-format", "json"],
                          log_path=log_path)
    try:
        body = {"model": tiny_llama_dir.name, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        server.close()
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    messages = [json.loads(line)["message"] for line in lines]  # each line is an object
    assert any(m.startswith("pdserve is serving") for m in messages), messages
    assert any(m.startswith("pdserve: process logs in") for m in messages), messages
