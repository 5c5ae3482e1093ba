"""Checks on an output path, made before a command's work."""

from __future__ import annotations

import os
from pathlib import Path

from headroom.contract.outputs import chart_error, output_error


def test_an_output_path_is_refused_before_the_work_with_the_flag_named(tmp_path: Path) -> None:
    assert output_error(tmp_path / "run.json", "--json") is None
    assert output_error(Path("-"), "--json") is None  # stdout
    assert output_error(tmp_path, "--json") == f"--json: {tmp_path} is a directory"
    gone = tmp_path / "nowhere" / "run.json"
    assert output_error(gone, "--csv") == f"--csv: no directory {gone.parent}"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    # root writes anywhere: the check asks the OS, so the expectation does too.
    writable = os.access(locked, os.W_OK)
    assert (output_error(locked / "x.json", "--json") is None) == writable


def test_a_chart_must_be_a_format_matplotlib_writes(tmp_path: Path) -> None:
    for name in ("a.png", "a.SVG", "a.pdf"):
        assert chart_error(tmp_path / name, "--plot") is None
    for name in ("a.txt", "a", ".png.bak"):
        err = chart_error(tmp_path / name, "--plot")
        assert err is not None and "must end in .png, .svg, .pdf" in err
