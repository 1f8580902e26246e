"""docs/design.md shows the import graph the source draws (tests/architecture/import_graph.py),
so it cannot drift from the code."""

from __future__ import annotations

from tests.architecture.import_graph import DESIGN, render, written_graph


def test_design_doc_shows_the_import_graph():
    written = written_graph(DESIGN.read_text(encoding="utf-8"))
    assert written is not None, "docs/design.md lost its import graph section"
    assert written == render(), "run: python -m tests.architecture.import_graph --write"


def test_the_graph_shows_the_layers_the_rules_allow():
    """A few edges the architecture relies on, read from the rendered graph itself."""
    text = render()
    assert "- `router/` imports `text/`, `wire/`" in text
    assert "- `wire/` imports none of them" in text
    assert "- `engine/cpu/` imports none of them" in text
