"""The engine core's size against nano-vllm's, counted the same way: code lines, without blank
lines, comments or docstrings (a line counts when a token other than a comment or a docstring
starts or continues on it).

The core is what issue 21 names: the block pool, the prefix cache, the KV manager, the
scheduler (with the step it hands the model runner) and the sequence. nano-vllm's equivalent is
its `nanovllm/engine/` `block_manager.py`, `scheduler.py` and `sequence.py` at the version with
chunked prefill (120, 92 and 83 lines in all), read with the search tool and counted by
`code_lines` below; it cannot be fetched at run time, so its counts are pinned here. Features
the core has beyond it: copy-on-write, LRU eviction of cached blocks, collision-checked chains
that survive eviction, the admission watermark, n > 1 siblings sharing a prompt, failure-safe
abort while a step runs, and the KV-block-seconds integral.

Target: the core at most 2x nano-vllm's lines. Exit 1 on a MISS.

Run: .venv/bin/python -m bench.core_lines
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine" / "headroom" / "engine"
CORE = (
    "block_pool.py",
    "prefix_cache.py",
    "kv_manager.py",
    "scheduler.py",
    "scheduled.py",
    "sequence.py",
)
# nano-vllm (GeeeekExplorer/nano-vllm, nanovllm/engine/), code lines by `code_lines`.
NANO_VLLM = {"block_manager.py": 102, "scheduler.py": 78, "sequence.py": 65}
TARGET_RATIO = 2.0
_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def docstring_lines(tree: ast.Module) -> set[int]:
    """Line numbers of the module's, classes' and functions' docstrings."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(source: str) -> int:
    """Lines holding code: no blank lines, no comments, no docstrings."""
    skip = docstring_lines(ast.parse(source))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _NOT_CODE:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in skip)
    return len(lines)


def main() -> int:
    ours = {name: code_lines((ENGINE / name).read_text()) for name in CORE}
    total, theirs = sum(ours.values()), sum(NANO_VLLM.values())
    ratio = total / theirs
    verdict = "PASS" if ratio <= TARGET_RATIO else "MISS"
    print("engine core vs nano-vllm, code lines (no blanks, comments or docstrings)")
    print()
    print(f"{'headroom.engine':<22}{'lines':>7}    {'nano-vllm':<20}{'lines':>7}")
    print("-" * 60)
    rows = max(len(ours), len(NANO_VLLM))
    left, right = list(ours.items()), list(NANO_VLLM.items())
    for i in range(rows):
        a = f"{left[i][0]:<22}{left[i][1]:>7}" if i < len(left) else " " * 29
        b = f"{right[i][0]:<20}{right[i][1]:>7}" if i < len(right) else ""
        print(f"{a}    {b}".rstrip())
    print("-" * 60)
    print(f"{'total':<22}{total:>7}    {'total':<20}{theirs:>7}")
    print()
    print(f"ratio {ratio:.2f}x (target <= {TARGET_RATIO:g}x): {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
