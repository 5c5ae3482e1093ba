"""The package layout never shadows the standard library, whatever the working directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stdlib_operator_survives_the_repo_root_on_sys_path() -> None:
    code = (
        "import operator, kopf, headroom.operator, headroom.engine, headroom.sidecar\n"
        "import headroom.contract\n"
        "assert operator.__file__.endswith('lib/python3.%d/operator.py' % __import__('sys')"
        ".version_info[1]), operator.__file__\n"
        "assert hasattr(operator, 'itemgetter')\n"
    )
    # `python -c` puts the working directory first on sys.path: the repo root here.
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_component_folders_are_source_roots_not_packages() -> None:
    for root in ("contract", "engine", "sidecar", "operator"):
        assert not (ROOT / root / "__init__.py").exists()
        assert not (ROOT / root / "headroom" / "__init__.py").exists()
        assert (ROOT / root / "headroom" / root / "__init__.py").exists()
