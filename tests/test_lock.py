"""The environment is the lock: uv.lock matches pyproject.toml, the venv holds exactly the
locked packages, and every checkout's venv imports that checkout's own files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
# What scripts/venv.sh installs.
EXTRAS = ("--extra", "engine", "--extra", "sim", "--extra", "dev", "--extra", "cuda")


def _uv() -> str:
    out = subprocess.run(
        [str(REPO / "scripts" / "uv.sh")], capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def _uv_env(tmp: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", UV_NO_PROGRESS="1")
    if tmp is not None:  # an empty cache: the check must not lean on downloaded metadata
        env["UV_CACHE_DIR"] = str(tmp / "uv-cache")
    return env


def _lock_check(project: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_uv(), "lock", "--check", "--offline", "--project", str(project), "--python", "3.11"],
        capture_output=True,
        text=True,
        env=_uv_env(tmp),
        timeout=120,
        check=False,
    )


def _project_copy(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "uv.lock", "setup.py", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    return dest


def test_lock_matches_pyproject(tmp_path: Path) -> None:
    proc = _lock_check(REPO, tmp_path)
    assert proc.returncode == 0, f"uv.lock is stale: run `make lock`\n{proc.stderr}"


def test_a_changed_range_without_a_new_lock_is_caught(tmp_path: Path) -> None:
    project = _project_copy(tmp_path / "project")
    pyproject = project / "pyproject.toml"
    text = pyproject.read_text()
    assert '"pyyaml>=6,<7"' in text
    pyproject.write_text(text.replace('"pyyaml>=6,<7"', '"pyyaml>=6.0.2,<7"'))
    assert _lock_check(project, tmp_path).returncode != 0


def _locked_for_this_interpreter() -> dict[str, str]:
    args = ["--no-emit-project", "--no-hashes", "--no-header", "--no-annotate"]
    proc = subprocess.run(
        [_uv(), "export", "--frozen", *EXTRAS, *args, "--project", str(REPO)],
        capture_output=True,
        text=True,
        env=_uv_env(),
        check=True,
    )
    locked: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        spec, _, marker = line.partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate():
            continue
        name, _, version = spec.strip().partition("==")
        locked[canonicalize_name(name.split("[")[0])] = version
    return locked


def test_venv_holds_exactly_the_lock() -> None:
    assert Path(sys.prefix) == REPO / ".venv", "run the tests with this checkout's .venv"
    installed = {
        canonicalize_name(d.metadata["Name"]): d.version
        for d in metadata.distributions()
        if canonicalize_name(d.metadata["Name"]) != "headroom"
    }
    locked = _locked_for_this_interpreter()
    assert installed == locked, {
        "missing": sorted(set(locked) - set(installed)),
        "extra": sorted(set(installed) - set(locked)),
        "version": sorted(n for n in set(locked) & set(installed) if locked[n] != installed[n]),
    }


def _checkout(dest: Path, marker: str) -> Path:
    """A second checkout: the project's tracked layout, with one file that tells it apart."""
    _project_copy(dest)
    for root in ("contract", "engine", "sidecar", "operator", "scripts"):
        shutil.copytree(
            REPO / root, dest / root, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    (dest / "engine" / "headroom" / "engine" / "_checkout.py").write_text(f"NAME = {marker!r}\n")
    return dest


@pytest.mark.slow
def test_two_checkouts_each_import_their_own_files(tmp_path: Path) -> None:
    clones = [_checkout(tmp_path / name, name) for name in ("first", "second")]
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    for clone in clones:  # one after the other: the second must not re-point the first
        subprocess.run([str(clone / "scripts" / "venv.sh")], env=env, check=True, timeout=600)
    probe = (
        "import headroom.contract, headroom.engine, headroom.sidecar, headroom.operator, shutil;"
        "from headroom.engine import _checkout;"
        "print(_checkout.NAME, headroom.engine.__file__, headroom.sidecar.__file__,"
        " headroom.operator.__file__, headroom.contract.__file__, shutil.which('headroom'))"
    )
    for clone in clones:
        venv_bin = clone / ".venv" / "bin"
        out = subprocess.run(
            [str(venv_bin / "python"), "-c", probe],
            capture_output=True,
            text=True,
            check=True,
            cwd=tmp_path,
            env={**env, "PATH": f"{venv_bin}:{env.get('PATH', '')}"},
        ).stdout.split()
        assert out[0] == clone.name
        for path in out[1:]:
            assert Path(path).resolve().is_relative_to(clone.resolve()), (clone, path)


@pytest.mark.slow
def test_the_operator_and_sidecar_install_without_torch(tmp_path: Path) -> None:
    """The lock without extras (what an operator or sidecar image installs): no torch, and the
    operator, the sidecar and the torch-free commands run; `serve` names the missing extra, and
    so do `profile` and `simulate` (numpy comes with `sim`), whose --help still works."""
    clone = _checkout(tmp_path / "slim", "slim")
    venv = tmp_path / "venv"
    cache = Path(os.environ.get("HEADROOM_CACHE") or Path.home() / ".cache" / "headroom")
    env = {**_uv_env(), "UV_CACHE_DIR": str(cache / "uv"), "UV_PROJECT_ENVIRONMENT": str(venv)}
    env.pop("VIRTUAL_ENV", None)
    subprocess.run(
        [_uv(), "sync", "--locked", "--no-dev", "--project", str(clone), "--python", "python3.11"],
        env=env, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    python, headroom = venv / "bin" / "python", venv / "bin" / "headroom"
    probe = (
        "import importlib.util, headroom.operator.handlers, headroom.sidecar.server;"
        "print([m for m in ('torch', 'numpy', 'tokenizers', 'cupy')"
        " if importlib.util.find_spec(m)])"
    )
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    for args in (["operator", "--help"], ["sidecar", "--help"], ["crd"],
                 ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--concurrency", "64",
                  "--context", "4096"]):  # fmt: skip
        proc = subprocess.run([str(headroom), *args], capture_output=True, text=True)
        assert proc.returncode == 0, (args, proc.stderr)
    served = subprocess.run([str(headroom), "serve", "--model", "tiny"], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert served.returncode == 2
    assert "pip install '.[engine]'" in served.stderr and "torch" in served.stderr
    assert "Traceback" not in served.stderr
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,10\n")
    spec = REPO / "examples" / "llama-3.1-8b-h100.yaml"
    for args in (["profile", str(trace)], ["simulate", str(trace), "--spec", str(spec)]):
        proc = subprocess.run([str(headroom), *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "pip install '.[sim]'" in proc.stderr and "numpy" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        helped = subprocess.run([str(headroom), args[0], "--help"], capture_output=True, text=True)
        assert helped.returncode == 0 and "TRACE" in helped.stdout, helped.stderr
