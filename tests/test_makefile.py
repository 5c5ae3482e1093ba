"""What every make target runs under: the user's HEADROOM_CACHE, and loopback kept off any
proxy the shell sets."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRINT = 'hr-print: ; @echo "$$no_proxy|$$NO_PROXY|$$HEADROOM_CACHE"'


def _make_env(**env: str) -> list[str]:
    make = shutil.which("make")
    assert make is not None
    base = {k: v for k, v in os.environ.items() if k not in ("no_proxy", "NO_PROXY", "MAKEFLAGS")}
    base.pop("HEADROOM_CACHE", None)
    out = subprocess.run([make, "-s", "--no-print-directory", "--eval", PRINT, "hr-print"],
                         cwd=REPO, env={**base, **env}, capture_output=True, text=True,
                         check=True)  # fmt: skip
    return out.stdout.strip().split("|")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_loopback_bypasses_the_proxy_and_the_users_cache_is_kept(tmp_path: Path) -> None:
    # curl and urllib send 127.0.0.1 to $http_proxy unless no_proxy names it: a proxy in the
    # shell would have taken the tests' loopback traffic off the machine.
    no_proxy, big, cache = _make_env(no_proxy="registry.internal", HEADROOM_CACHE=str(tmp_path))
    assert no_proxy == "registry.internal,127.0.0.1,localhost,::1"
    assert big == "127.0.0.1,localhost,::1"
    assert cache == str(tmp_path)  # it used to be ~/.cache/headroom whatever the shell said
    assert _make_env(HOME=str(tmp_path))[2] == f"{tmp_path}/.cache/headroom"
