"""bench.core_lines counts the whole core: what it imports is counted or excused by name."""

from __future__ import annotations

import pytest

from bench import core_lines


def test_every_module_the_core_imports_is_counted_or_excused() -> None:
    assert core_lines.uncounted() == []


def test_a_module_split_out_of_the_core_is_a_miss(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    core = {k: v for k, v in core_lines.CORE.items() if k != "scheduled.py"}
    monkeypatch.setattr(core_lines, "CORE", core)
    assert core_lines.uncounted() == ["headroom.engine.scheduled"]
    assert core_lines.main() == 1
    out = capsys.readouterr().out
    assert "neither counted nor excused: headroom.engine.scheduled" in out and "MISS" in out


def test_code_lines_skips_blanks_comments_and_docstrings() -> None:
    source = (
        '"""Module."""\n\n# a comment\ndef f() -> int:\n    """Doc\n    string."""\n'
        "    return (1 +\n            2)\n"
    )
    assert core_lines.code_lines(source) == 3
