"""The three parts import the contract and never each other; the contract imports no part.

Read from the source with `ast`, so an import hidden in a function body counts as much as one at
the top of a module. The umbrella CLI names each subcommand's module as a string and imports
only the one chosen: that table is the contract's only reference to the parts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("engine", "sidecar", "operator")


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from headroom import engine` reaches a part as surely as `import headroom.engine`
            if node.module == "headroom":
                found += [(node.lineno, f"headroom.{a.name}") for a in node.names]
    return found


def _part_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "headroom" else None


def _sources(root: str) -> list[Path]:
    files = sorted((ROOT / root / "headroom").rglob("*.py"))
    assert files, f"no sources under {root}/headroom"
    return files


@pytest.mark.parametrize("part", PARTS)
def test_a_part_imports_only_itself_and_the_contract(part: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _sources(part)
        for line, module in _imports(path)
        if _part_of(module) not in (None, part, "contract")
    ]
    assert not wrong, "parts must talk through headroom.contract:\n" + "\n".join(wrong)


def test_the_contract_imports_no_part() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _sources("contract")
        for line, module in _imports(path)
        if _part_of(module) in PARTS
    ]
    assert not wrong, "the contract must not depend on a part:\n" + "\n".join(wrong)


def test_the_check_sees_a_cross_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from headroom.engine.block_pool import BlockPool\n")
    bad2 = tmp_path / "bad2.py"
    bad2.write_text("from headroom import sidecar\n")
    assert [_part_of(m) for _, m in _imports(bad)] == ["engine"]
    assert "sidecar" in [_part_of(m) for _, m in _imports(bad2)]


def test_every_source_root_holds_exactly_its_own_slice() -> None:
    for root in ("contract", *PARTS):
        slices = {p.name for p in (ROOT / root / "headroom").iterdir() if p.is_dir()}
        assert slices - {"__pycache__"} == {root}, f"{root}/headroom holds {sorted(slices)}"
