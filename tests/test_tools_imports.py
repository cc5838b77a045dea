"""The command modules import no circle (issue 40): ``cli`` registers ``demo``, ``ops`` and
``bench``; what they share (error wording, ``--url``'s check, waiting for Ctrl-C) lives in
``s3kv/tools/options.py``, which imports none of them. Read from the source, function-level
imports included, as ``tests/test_layering.py`` reads it."""

from __future__ import annotations

import pytest
from test_layering import MODULES, _imports


def _graph() -> dict[str, set[str]]:
    tools = [m for m in MODULES if m == "s3kv.cli" or m.startswith("s3kv.tools")]
    return {m: {n for _, n in _imports(m) if n in tools and n != m} for m in tools}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in ``graph`` (a path that ends where it starts), else None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_command_modules_import_no_circle():
    found = _cycle(_graph())
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_the_circle_check_can_fail(tmp_path, monkeypatch):
    """demo importing a helper from cli again (what it did before options.py) is a circle."""
    src = MODULES["s3kv.tools.demo"].read_text() + "\n\ndef _x():\n    from .cli import main\n"
    (tmp_path / "demo.py").write_text(src)
    monkeypatch.setitem(MODULES, "s3kv.tools.demo", tmp_path / "demo.py")
    with pytest.raises(AssertionError, match=r"import circle: s3kv.tools.cli -> .*s3kv.tools.demo -> s3kv.tools.cli"):
        test_the_command_modules_import_no_circle()
