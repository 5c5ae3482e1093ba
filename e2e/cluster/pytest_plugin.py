"""pytest plugin: the session-scoped ``cluster`` fixture (a real control plane, see harness.py).

Register it with ``pytest_plugins = ["e2e.cluster.pytest_plugin"]``.

* The binaries are built (or found in the cache) right after collection when any selected test
  uses ``cluster``, outside every test's timeout, so a cold build is not cut off by
  pytest-timeout.
* The cluster starts once per session on first use and is stopped at the end.
* If the build is impossible on this machine, the tests that need the cluster FAIL (in CI and
  outside it alike: the control plane is part of the test suite, not an optional extra) with a
  loud reason naming the failing piece and saying to run ``make cluster-build``, repeated in the
  terminal summary. A cluster that was built but does not start is an error too.
* ``HEADROOM_CLUSTER_ENV=/path/to/cluster.env`` uses an already running cluster (from
  ``make cluster-up``) and leaves it running.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NoReturn

import pytest

from e2e.cluster.harness import BuildError, BuildResult, Cluster, ClusterError, build, cache_dir


@dataclass
class _State:
    wanted: bool = False
    result: BuildResult | None = None
    error: BuildError | None = None
    start_seconds: float | None = None
    notes: list[str] = field(default_factory=list)


_state = _State()


BUILD_HINT = "run `make cluster-build` (e2e/cluster/build.sh) and see its log"


def missing_piece(reason: str) -> NoReturn:
    """Fail a test that needs a piece of the test cluster this machine lacks; never skip."""
    pytest.fail(f"{reason}\n=> {BUILD_HINT}", pytrace=False)


def _loud(reason: str) -> str:
    bar = "!" * 78
    return f"\n{bar}\n!! headroom test cluster UNAVAILABLE: {reason}\n{bar}"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries before the first test when any selected test uses ``cluster``."""
    if session.config.option.collectonly:
        return
    if not any("cluster" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    _state.wanted = True
    if os.environ.get("HEADROOM_CLUSTER_ENV"):
        _state.notes.append(f"using the running cluster of {os.environ['HEADROOM_CLUSTER_ENV']}")
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")

    def progress(line: str) -> None:
        if tr is not None and line.startswith("[cluster-build]"):
            tr.write_line(line)

    if tr is not None:
        tr.write_line("[cluster-build] checking the test control plane's binaries (e2e/cluster)")
    try:
        _state.result = build(progress=progress)
    except BuildError as exc:
        _state.error = exc
        if tr is not None:
            tr.write_line(
                _loud(
                    f"build impossible here; failing piece(s): {', '.join(exc.pieces)}; "
                    f"{BUILD_HINT}"
                ),
                red=True,
                bold=True,
            )
            tr.write_line(str(exc)[-3000:], red=True)
        return
    res = _state.result
    if res.cold:
        _state.notes.append(
            f"built the binaries in {res.seconds:.0f}s ({res.recorded}): {res.bin_dir}"
        )
    else:
        _state.notes.append(
            f"control-plane binaries cached in {res.bin_dir} ({res.recorded or 'cold build'})"
        )
    if res.failed:
        _state.notes.append(f"could not build: {', '.join(res.failed)} (see {res.bin_dir}/.failed)")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Report the build and start timings, and loudly any piece that could not be built."""
    if not _state.wanted:
        return
    tr = terminalreporter
    tr.section("headroom test cluster")
    if _state.error is not None:
        pieces = ", ".join(_state.error.pieces)
        tr.write_line(
            _loud(
                f"build impossible here; failing piece(s): {pieces}; cluster tests FAILED; "
                f"{BUILD_HINT}"
            ),
            red=True,
            bold=True,
        )
    for note in _state.notes:
        tr.write_line(note)
    if _state.start_seconds is not None:
        tr.write_line(f"control plane start (warm binaries): {_state.start_seconds:.1f}s")


def _reap_orphans() -> None:
    """Stop clusters left by pytest runs that died (``pytest-<pid>`` with that pid gone)."""
    root = cache_dir() / "cluster"
    for d in sorted(root.glob("pytest-*")) if root.is_dir() else []:
        suffix = d.name.removeprefix("pytest-")
        if not d.is_dir() or not suffix.isdigit() or int(suffix) == os.getpid():
            continue
        try:
            os.kill(int(suffix), 0)
            continue  # that pytest still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(ClusterError):
            Cluster(d.name).down()


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """A running control plane with kwok GPU nodes, shared by the whole session."""
    env_file = os.environ.get("HEADROOM_CLUSTER_ENV")
    if env_file:
        yield Cluster(os.environ.get("HEADROOM_CLUSTER_NAME", "default")).attach(env_file)
        return
    if _state.error is None and _state.result is None:
        # Not built at collection (e.g. the fixture was requested dynamically): build now.
        try:
            _state.result = build()
        except BuildError as exc:
            _state.error = exc
    if _state.error is not None:
        pieces = ", ".join(_state.error.pieces)
        missing_piece(
            f"headroom test cluster UNAVAILABLE: build impossible; failing piece(s): {pieces}: "
            f"{str(_state.error)[:1500]}"
        )
    _reap_orphans()
    c = Cluster(f"pytest-{os.getpid()}")
    t0 = time.monotonic()
    c.up()
    _state.start_seconds = c.start_seconds or time.monotonic() - t0
    if _state.result is not None:
        c.build_result = _state.result  # the collection-time build, with its timing
    try:
        yield c
    finally:
        c.down()


@pytest.fixture
def cluster_namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted (without waiting) afterwards."""
    base = "".join(ch if ch.isalnum() else "-" for ch in request.node.name.lower())[:40]
    name = f"t-{base.strip('-')}-{os.getpid() % 10000}-{int(time.time() * 1000) % 100000}"
    cluster.create_namespace(name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
