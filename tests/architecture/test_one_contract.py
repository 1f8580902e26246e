"""The sampling contract has one check: the bounds of a sampling setting are written once, in
`SamplingParams`' construction (wire/sampling_params.py), which the router runs to build what
it sends and each node runs again as the message lands. Counted in the source, not assumed:
every comparison or range check of `max_tokens` against a constant bound, in any module the
processes run, is found and must be that one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("router", "node", "engine", "prefill_node", "decode_node", "wire")
BOUNDS = {"INT32_MAX"}
ORDERS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)  # a bound; `== 0` names echo's special value


def _names(node: ast.AST) -> set[str]:
    return {
        n.id if isinstance(n, ast.Name) else n.attr
        for n in ast.walk(node)
        if isinstance(n, (ast.Name, ast.Attribute))
    }


def _is_bound(node: ast.AST) -> bool:
    constant = isinstance(node, ast.Constant) and node.value in (0, 1)
    return constant or bool(_names(node) & BOUNDS)


def max_tokens_bound_checks(tree: ast.AST) -> list[int]:
    """Lines that order `max_tokens` itself against 0, 1 or INT32_MAX, or pass it with such a
    bound to a range check (`_integer("max_tokens", value, 1, INT32_MAX)`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and all(isinstance(op, ORDERS) for op in node.ops):
            sides = [node.left, *node.comparators]
            plain = [s for s in sides if isinstance(s, (ast.Name, ast.Attribute))]
            if any(_names(s) == {"max_tokens"} or getattr(s, "attr", None) == "max_tokens"
                   for s in plain) and any(_is_bound(s) for s in sides):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call):
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if "max_tokens" in names and any(_is_bound(a) for a in node.args[1:]):
                lines.append(node.lineno)
    return sorted(lines)


def test_max_tokens_is_bounded_in_one_place():
    found = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = max_tokens_bound_checks(ast.parse(path.read_text(), str(path)))
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert list(found) == ["wire/sampling_params.py"], found
    assert len(found["wire/sampling_params.py"]) == 1, found


def test_the_counter_sees_the_checks_it_counts():
    """The counter finds a check written either way, so the test above can fail."""
    source = (
        "if not 1 <= req.max_tokens <= INT32_MAX: pass\n"
        "if max_tokens < 1: pass\n"
        "x = _integer('max_tokens', value, 1, INT32_MAX)\n"
        "if prompt_len + max_tokens > max_model_len: pass\n"
    )
    assert max_tokens_bound_checks(ast.parse(source)) == [1, 2, 3]
