"""What the thinking tests (test_reasoning.py, test_langchain.py) ask of conftest.py's
`qwen3_reasoning_server`: random weights think only when made to, so a `guided_regex` forces
the shape of an answer that thinks (a short thinking block, then a short answer)."""

from __future__ import annotations

THINK_THEN_ANSWER = r"<think>[a-z]{4,8}</think>\n\n[a-z]{3,6}"
MESSAGES = [{"role": "user", "content": "Think, then answer."}]
