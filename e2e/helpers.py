"""Utilities the e2e scenarios share: local processes with cleanup, polling, Prometheus.

Every process is started in its own session and stopped by its own process group, so a failed
test never leaves an engine, sidecar, operator or Prometheus behind and never touches a process
it did not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = REPO / ".venv" / "bin"
PROMETHEUS = os.environ.get("HEADROOM_PROMETHEUS", "/usr/bin/prometheus")

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def headroom_argv() -> list[str]:
    """The `headroom` console script of this checkout's venv."""
    script = VENV_BIN / "headroom"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "headroom.contract.cli"]


def headroom_help_error(command: str) -> str | None:
    """Why `headroom <command> --help` fails in this checkout's venv; None when it works."""
    out = subprocess.run(
        [*headroom_argv(), command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode == 0:
        return None
    tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-5:])
    return f"`headroom {command} --help` exited {out.returncode}: {tail}"


def headroom_has(command: str) -> bool:
    """Whether this build's `headroom` CLI runs `command`."""
    return headroom_help_error(command) is None


def wait_until(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.2,
    what: str,
    alive: Callable[[], None] | None = None,
) -> T:
    """Call `probe` until it returns something truthy; raise TimeoutError naming `what`.

    `alive` is called each round and may raise to stop early (a process that exited)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        if alive is not None:
            alive()
        try:
            value = probe()
        except Exception as exc:  # a probe that fails is retried; the last error is reported
            value, last = None, exc
        else:
            last = value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def http_get(url: str, timeout: float = 2.0) -> bytes:
    """GET a URL; raises on a non-2xx status."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())


def http_json(url: str, timeout: float = 2.0) -> Any:
    """GET a URL and decode its JSON body."""
    return json.loads(http_get(url, timeout))


def http_ok(url: str) -> bool:
    """Whether a GET of the URL answers 2xx now."""
    try:
        http_get(url, timeout=1.0)
    except (OSError, urllib.error.URLError):
        return False
    return True


@dataclass
class Proc:
    """A local process started by a test, logging to a file, stopped by its process group."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: Path = REPO
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0

    def start(self) -> Proc:
        """Start it in a new session (its own process group)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        self.popen = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.cwd,
            env=full_env,
            start_new_session=True,
        )
        log.close()
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def check_alive(self) -> None:
        """Raise with the log's tail when the process has exited."""
        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        """The last lines of its log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        """Signal its process group, wait `grace` seconds, then SIGKILL; returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)
        # Children that outlived the leader still hold the group id; reap them too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        return self.popen.returncode

    def kill(self) -> int | None:
        """SIGKILL at once: a crash, not a shutdown."""
        return self.stop(grace=5.0, sig=signal.SIGKILL)


@dataclass
class Processes:
    """The processes one test started; `stop_all` runs in reverse start order."""

    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        """Start a process logging to `<log_dir>/<name>.log` and track it for cleanup."""
        proc = Proc(name, list(argv), self.log_dir / f"{name}.log", env=env).start()
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def report(self) -> str:
        """The tail of every log, for a failure message."""
        return "\n".join(f"----- {p.name} ({p.log_path})\n{p.tail()}" for p in self.procs)


@contextlib.contextmanager
def processes(log_dir: Path) -> Iterator[Processes]:
    """A `Processes` whose members are all stopped on exit, whatever happened."""
    group = Processes(log_dir)
    try:
        yield group
    finally:
        group.stop_all()


def start_sidecar(
    group: Processes,
    engine_url: str,
    *,
    pod: str,
    namespace: str,
    inferencedeployment: str,
    source: Sequence[str] = (),
) -> tuple[Proc, int]:
    """A `headroom sidecar` on 127.0.0.1 for one pod at e2e speed (0.5 s polls, 10 s windows),
    returned with its port once `/healthz` answers; `source` adds `--source`-style flags."""
    port = free_port()
    proc = group.start(
        "sidecar",
        [
            *headroom_argv(), "sidecar", "--engine-url", engine_url, *source,
            "--host", "127.0.0.1", "--port", str(port),
            "--interval", "0.5", "--timeout", "0.4", "--forecast-window", "10", "--window", "10",
            "--pod", pod, "--namespace", namespace, "--inferencedeployment", inferencedeployment,
        ],
    )  # fmt: skip
    wait_until(
        lambda: http_ok(f"http://127.0.0.1:{port}/healthz"),
        timeout=120,
        what="sidecar /healthz",
        alive=proc.check_alive,
    )
    return proc, port


class Prometheus:
    """Debian's Prometheus on 127.0.0.1 with a free port, temp storage and static targets."""

    def __init__(
        self,
        group: Processes,
        targets: dict[str, list[str]],
        *,
        scrape_interval: str = "1s",
        binary: str = PROMETHEUS,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = Path(tempfile.mkdtemp(prefix="headroom-prom-", dir=group.log_dir))
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [
                {
                    "job_name": job,
                    # The sidecar sets namespace/pod/inferencedeployment itself; keep them.
                    "honor_labels": True,
                    "static_configs": [{"targets": addrs}],
                }
                for job, addrs in targets.items()
            ],
        }
        cfg = self._dir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        self.proc = group.start(
            "prometheus",
            [
                binary,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={self._dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        wait_until(
            lambda: http_ok(f"{self.url}/-/ready"),
            timeout=timeout,
            what="Prometheus /-/ready",
            alive=self.proc.check_alive,
        )

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        q = urllib.parse.urlencode({"query": expr})
        body = http_json(f"{self.url}/api/v1/query?{q}")
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return list(body["data"]["result"])

    def scalar(self, expr: str) -> float | None:
        """The first sample of an instant query, or None when the vector is empty."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def targets_up(self) -> bool:
        """Whether every configured target's last scrape succeeded."""
        body = http_json(f"{self.url}/api/v1/targets?state=active")
        active = body["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)


@dataclass
class Timings:
    """Wall-clock seconds of named phases, printed as a table at the end of the session."""

    phases: list[tuple[str, float]] = field(default_factory=list)
    # Figures measured inside a test (lead times, convergence): printed, not added up.
    figures: list[tuple[str, float]] = field(default_factory=list)

    def figure(self, name: str, seconds: float) -> None:
        """Record a duration measured inside a test."""
        self.figures.append((name, seconds))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.phases.append((name, time.monotonic() - t0))

    def table(self) -> str:
        """Every phase, in order, with the total."""
        return table_of(self.phases)

    def by_prefix(self) -> str:
        """Phases summed by what precedes `::` or `:` (the test file, or `setup`)."""
        sums: dict[str, float] = {}
        for name, secs in self.phases:
            key = name.split("::")[0] if "::" in name else name.split(":")[0]
            sums[key] = sums.get(key, 0.0) + secs
        return table_of(list(sums.items()))


def table_of(rows: list[tuple[str, float]], *, total: bool = True) -> str:
    """Aligned `name  seconds` lines, with a total line when the rows add up."""
    if not rows:
        return ""
    width = max(len(n) for n, _ in rows)
    lines = [f"{n:<{width}}  {s:8.1f} s" for n, s in rows]
    if total:
        lines.append(f"{'total':<{width}}  {sum(s for _, s in rows):8.1f} s")
    return "\n".join(lines)


class Operator:
    """`headroom operator` as a local process, cluster-wide, authenticated by one kubeconfig."""

    def __init__(self, group: Processes, kubeconfig: Path) -> None:
        self.group = group
        self.kubeconfig = kubeconfig
        self.metrics_port = 0
        self.proc: Proc | None = None
        self.starts = 0

    def start(self, timeout: float = 120.0) -> Proc:
        """Start it and wait for its /healthz (kopf answers once it has connected)."""
        self.starts += 1
        self.metrics_port = free_port()
        health = free_port()
        argv = [
            *headroom_argv(),
            "operator",
            "--all-namespaces",
            # The scenarios' specs name their own Prometheus, on this machine.
            "--allow-prometheus-url",
            "http://127.0.0.1:*",
            "--kubeconfig",
            str(self.kubeconfig),
            "--metrics-port",
            str(self.metrics_port),
            "--liveness-port",
            str(health),
            "--log-format",
            "text",
        ]
        # The kubeconfig is the only credential it gets: no admin KUBECONFIG leaks in.
        env = {"KUBECONFIG": str(self.kubeconfig)}
        self.proc = self.group.start(f"operator-{self.starts}", argv, env=env)
        wait_until(
            lambda: http_ok(f"http://127.0.0.1:{health}/healthz"),
            timeout=timeout,
            what="the operator's /healthz",
            alive=self.proc.check_alive,
        )
        return self.proc

    def check_alive(self) -> None:
        """Raise with its log's tail when it has exited."""
        if self.proc is not None:
            self.proc.check_alive()

    def metrics(self) -> str:
        """Its own /metrics text."""
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics").decode()

    def logs(self) -> str:
        """Everything every start of it has logged."""
        return "\n".join(
            p.log_path.read_text(errors="replace")
            for p in self.group.procs
            if p.name.startswith("operator-") and p.log_path.exists()
        )
