"""A real Kubernetes control plane for tests: build it, start it, drive it, stop it.

The shell scripts next to this module do the work (``build.sh``, ``up.sh``, ``down.sh``); this
module is the Python face of them::

    from e2e.cluster.harness import Cluster

    with Cluster("mytest") as c:          # up() on enter, down() on exit
        c.kubectl("get", "nodes")
        c.apply(yaml_text)
        kc = c.sa_kubeconfig("default", "robot")   # kubeconfig holding a ServiceAccount token
        c.kubectl("auth", "can-i", "list", "pods", kubeconfig=kc, check=False)

Everything runs on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
kwok, whose fake nodes advertise ``nvidia.com/gpu: 8``. Pod and node IPs are loopback addresses
from a /16 of the cluster's own (``pod_network``, see podnet.py): nothing listens on them unless
a test binds one, and traffic to them never leaves the machine.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import math
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import yaml

HERE = Path(__file__).resolve().parent
BUILD_SH = HERE / "build.sh"
UP_SH = HERE / "up.sh"
DOWN_SH = HERE / "down.sh"

#: The binaries ``build.sh`` produces; the first five are needed to start a cluster.
CORE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
)
ALL_BINARIES = (*CORE_BINARIES, "helm")
#: What kubectl wait prints for an object whose ``.status.conditions`` is still null.
_NO_CONDITIONS = ".status.conditions accessor error: <nil>"


def cache_dir() -> Path:
    """The headroom cache root (``$HEADROOM_CACHE`` or ``~/.cache/headroom``)."""
    return Path(os.environ.get("HEADROOM_CACHE") or Path.home() / ".cache" / "headroom")


class ClusterError(RuntimeError):
    """The cluster could not be started, stopped or driven."""


class BuildError(ClusterError):
    """Some binaries of the control plane cannot be built on this machine.

    ``pieces`` names what failed (e.g. ``["kube-apiserver"]``, or ``["go toolchain"]``).
    """

    def __init__(self, message: str, pieces: Sequence[str]) -> None:
        super().__init__(message)
        self.pieces = list(pieces)


class CommandError(ClusterError):
    """A kubectl/helm command exited non-zero; carries the completed process."""

    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        cmd = shlex.join(str(a) for a in proc.args)
        super().__init__(
            f"command failed (rc={proc.returncode}): {cmd}\n"
            f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
        self.proc = proc


@dataclass
class BuildResult:
    """Where the binaries are and what the build cost."""

    bin_dir: Path
    seconds: float
    cold: bool  # built in this call (False: found complete in the cache)
    recorded: str = ""  # build.sh's record: "cold build: 1234s on 2 CPUs" or "rebuild: ..."
    failed: list[str] = field(default_factory=list)
    log: str = ""


def build(
    *, timeout: float | None = None, progress: Callable[[str], None] | None = None
) -> BuildResult:
    """Build (or reuse) the versioned binaries with ``build.sh``.

    ``progress`` gets each line ``build.sh`` logs (a cold build takes many minutes). Raises
    :class:`BuildError` when a core piece cannot be built; a failing ``helm`` alone is reported
    in ``BuildResult.failed`` and leaves the cluster usable.
    """
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    log_lines: list[str] = []
    with subprocess.Popen(
        ["bash", str(BUILD_SH)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stderr is not None and proc.stdout is not None
        for line in proc.stderr:
            log_lines.append(line.rstrip("\n"))
            if progress is not None:
                progress(line.rstrip("\n"))
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
                raise BuildError(f"build.sh did not finish within {timeout}s", ["build (timeout)"])
        stdout = proc.stdout.read()
        rc = proc.wait()
    seconds = time.monotonic() - start
    log = "\n".join(log_lines)
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if rc == 2:
        fatal = [ln for ln in log_lines if "FATAL" in ln]
        piece = (
            "the Go toolchain" if any(" Go " in ln or "(go)" in ln for ln in fatal) else "prereqs"
        )
        raise BuildError(
            f"cannot build the test control plane: {' '.join(fatal) or log[-2000:]}", [piece]
        )
    if rc not in (0, 3) or not lines:
        raise BuildError(f"build.sh failed (rc={rc}):\n{log[-4000:]}", ["build.sh"])
    bin_dir = Path(lines[-1])
    failed: list[str] = []
    if rc == 3:
        m = re.search(r"FAILED PIECES: ([^()\n]+)", log)
        failed = m.group(1).split() if m else ["unknown"]
        details = (bin_dir / ".failed").read_text() if (bin_dir / ".failed").exists() else log
        core_failed = [p for p in failed if p in CORE_BINARIES]
        if core_failed:
            raise BuildError(
                f"cannot build {', '.join(core_failed)} on this machine:\n{details[-4000:]}",
                core_failed,
            )
    stamp = bin_dir / ".complete"
    recorded = stamp.read_text().strip() if stamp.exists() else ""
    cold = "warm; nothing to build" not in log
    return BuildResult(bin_dir, seconds, cold, recorded, failed, log)


def _read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "=" not in line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        env[key.strip()] = value.strip().strip('"')
    return env


class Cluster:
    """One test control plane, named so several can run side by side.

    ``up()`` builds what is missing and starts everything; ``down()`` stops exactly what
    ``up()`` started and removes the state directory. After ``up()`` (or
    :meth:`attach`), ``kubeconfig`` is the admin kubeconfig (``system:masters``) and
    ``server`` the API server URL.
    """

    def __init__(
        self,
        name: str = "default",
        *,
        state_dir: Path | str | None = None,
        nodes: int = 2,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.state_dir = (
            Path(state_dir) if state_dir is not None else cache_dir() / "cluster" / name
        ).resolve()
        self.nodes = nodes
        self.extra_env = dict(extra_env or {})
        self.start_seconds: float | None = None
        self.up_log = ""
        self.build_result: BuildResult | None = None
        self._info: dict[str, str] = {}
        #: True while this object runs the cluster it started with up() (not after attach()).
        self.owned = False

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def env_file(self) -> Path:
        """``cluster.env`` of this cluster (written by ``up.sh``)."""
        return self.state_dir / "cluster.env"

    def _script_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env["HEADROOM_CLUSTER_DIR"] = str(self.state_dir)
        env["HEADROOM_KWOK_NODES"] = str(self.nodes)
        return env

    def up(self, *, timeout: float = 300) -> Cluster:
        """Start the cluster, building the binaries first if needed; returns ``self``.

        ``timeout`` bounds the start, not the build (a cold build takes many minutes). If a
        ready cluster of this name already runs, it is reused. Raises :class:`BuildError` when
        the binaries cannot be built and :class:`ClusterError` when the cluster does not start.
        """
        self.build_result = build()
        start = time.monotonic()
        try:
            proc = subprocess.run(
                ["bash", str(UP_SH), self.name],
                env=self._script_env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            with contextlib.suppress(ClusterError):
                self.down(keep_state=True)
            raise ClusterError(
                f"up.sh {self.name} did not finish within {timeout}s; logs kept in "
                f"{self.state_dir / 'logs'}"
            ) from exc
        if proc.returncode != 0:
            raise ClusterError(
                f"up.sh {self.name} failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}"
            )
        self.start_seconds = time.monotonic() - start
        self.up_log = proc.stderr
        self._info = _read_env_file(self.env_file)
        self.owned = True
        return self

    def attach(self, env_file: Path | str | None = None) -> Cluster:
        """Use an already running cluster (its ``cluster.env``) without owning it."""
        path = Path(env_file) if env_file is not None else self.env_file
        self._info = _read_env_file(path)
        self.state_dir = Path(self._info["HEADROOM_CLUSTER_DIR"])
        self.owned = False
        return self

    def down(self, *, keep_state: bool = False) -> None:
        """Stop the processes ``up()`` started and remove the state directory."""
        env = self._script_env()
        if keep_state:
            env["HEADROOM_KEEP_CLUSTER_DIR"] = "1"
        proc = subprocess.run(
            ["bash", str(DOWN_SH), self.name],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            raise ClusterError(f"down.sh {self.name} failed:\n{proc.stderr}")
        self.owned = False

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    # ---- facts ----------------------------------------------------------------------------
    def _get(self, key: str) -> str:
        if not self._info:
            raise ClusterError(f"cluster {self.name} is not up (call up() or attach())")
        return self._info[key]

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (client certificate in ``system:masters``)."""
        return Path(self._get("KUBECONFIG"))

    @property
    def server(self) -> str:
        """API server URL, ``https://127.0.0.1:<port>``."""
        return self._get("HEADROOM_KUBE_SERVER")

    @property
    def pod_network(self) -> ipaddress.IPv4Network:
        """The loopback /16 the kwok nodes hand pod IPs from, e.g. ``127.77.0.0/16``."""
        return ipaddress.IPv4Network(self._get("HEADROOM_KWOK_POD_NET"))

    @property
    def bin_dir(self) -> Path:
        """Directory with kube-apiserver, kubectl, helm, kwok, ... of this cluster."""
        return Path(self._get("HEADROOM_CLUSTER_BIN"))

    @property
    def ca_file(self) -> Path:
        """The cluster CA certificate (it also signs the serving certificates)."""
        return self.state_dir / "pki" / "ca.crt"

    @property
    def version(self) -> str:
        """Kubernetes version of the control plane, e.g. ``v1.36.3``."""
        return self._get("HEADROOM_KUBE_VERSION")

    @property
    def pids(self) -> dict[str, int]:
        """Component name -> pid of every process ``up.sh`` started."""
        out: dict[str, int] = {}
        for item in self._get("HEADROOM_CLUSTER_PIDS").split():
            name, _, pid = item.partition(":")
            out[name] = int(pid)
        return out

    def log(self, component: str) -> str:
        """The log of one component (``etcd``, ``kube-apiserver``, ``kwok``, ...)."""
        path = self.state_dir / "logs" / f"{component}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def env(self, kubeconfig: Path | str | None = None) -> dict[str, str]:
        """``os.environ`` plus ``KUBECONFIG`` and the cluster's bin dir first on ``PATH``."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(kubeconfig or self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    # ---- commands -------------------------------------------------------------------------
    def _run(
        self,
        tool: str,
        args: Sequence[str],
        *,
        input: str | None,
        check: bool,
        timeout: float,
        kubeconfig: Path | str | None,
        env_extra: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        kc = str(kubeconfig or self.kubeconfig)
        cmd = [str(self.bin_dir / tool), "--kubeconfig", kc, *map(str, args)]
        env = self.env(kc)
        env.update(env_extra or {})
        proc = subprocess.run(
            cmd,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
        if check and proc.returncode != 0:
            raise CommandError(proc)
        return proc

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120,
        kubeconfig: Path | str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the cluster's kubectl; raises :class:`CommandError` on failure if ``check``."""
        return self._run(
            "kubectl", args, input=input, check=check, timeout=timeout, kubeconfig=kubeconfig
        )

    def helm(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 300,
        kubeconfig: Path | str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the cluster's helm against this cluster (its caches kept in the state dir)."""
        helm_home = self.state_dir / "helm"
        env_extra = {
            f"HELM_{sub.upper()}_HOME": str(helm_home / sub) for sub in ("cache", "config", "data")
        }
        for d in env_extra.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        return self._run(
            "helm",
            args,
            input=input,
            check=check,
            timeout=timeout,
            kubeconfig=kubeconfig,
            env_extra=env_extra,
        )

    def apply(self, manifest: str | Sequence[Mapping[str, object]], namespace: str = "") -> str:
        """``kubectl apply -f -`` of YAML text or a list of objects; returns kubectl's output."""
        text = manifest if isinstance(manifest, str) else yaml.safe_dump_all(list(manifest))
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.kubectl(*args, input=text).stdout

    def get(self, kind: str, name: str = "", namespace: str = "") -> dict[str, object]:
        """``kubectl get -o json`` parsed (a List when ``name`` is empty)."""
        import json

        args = ["get", kind, *([name] if name else []), "-o", "json"]
        if namespace:
            args += ["-n", namespace]
        result: dict[str, object] = json.loads(self.kubectl(*args).stdout)
        return result

    def wait(self, *args: str, timeout: float = 120) -> str:
        """``kubectl wait ... --timeout=<timeout>s``; returns its output. An object whose
        ``.status.conditions`` is still null is waited on too, not an error."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(1, math.ceil(deadline - time.monotonic()))
            proc = self.kubectl("wait", *args, f"--timeout={left}s", timeout=left + 30, check=False)
            if proc.returncode == 0:
                return proc.stdout
            # kubectl fails at once, rather than waiting, on an object whose status has no
            # conditions yet: a CRD in the moment after it is created, before the API server
            # writes Established.
            if _NO_CONDITIONS not in proc.stderr or time.monotonic() >= deadline:
                raise CommandError(proc)
            time.sleep(0.2)

    # ---- identities -----------------------------------------------------------------------
    def token(self, namespace: str, name: str, *, duration: str = "1h") -> str:
        """A bound token for ServiceAccount ``namespace/name`` (``kubectl create token``)."""
        return self.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={duration}"
        ).stdout.strip()

    def sa_kubeconfig(
        self,
        namespace: str,
        name: str,
        *,
        create: bool = True,
        duration: str = "1h",
        path: Path | str | None = None,
    ) -> Path:
        """A kubeconfig that authenticates as ServiceAccount ``namespace/name``.

        Creates the ServiceAccount when ``create`` (and it does not exist yet). RBAC applies:
        bind roles to ``system:serviceaccount:<namespace>:<name>`` to grant it anything.
        """
        if create:
            have = self.kubectl("get", "serviceaccount", name, "-n", namespace, check=False)
            if have.returncode != 0:
                self.kubectl("create", "serviceaccount", name, "-n", namespace)
        token = self.token(namespace, name, duration=duration)
        out = (
            Path(path)
            if path is not None
            else self.state_dir / "kubeconfigs" / f"sa-{namespace}-{name}.kubeconfig"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        user = f"system:serviceaccount:{namespace}:{name}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": f"headroom-{self.name}",
                    "cluster": {"server": self.server, "certificate-authority-data": ca},
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {
                    "name": user,
                    "context": {
                        "cluster": f"headroom-{self.name}",
                        "user": user,
                        "namespace": namespace,
                    },
                }
            ],
            "current-context": user,
        }
        out.write_text(yaml.safe_dump(config, sort_keys=False))
        out.chmod(0o600)
        return out

    def create_namespace(self, name: str) -> str:
        """Create a namespace and wait for its ``default`` ServiceAccount; returns ``name``."""
        self.kubectl("create", "namespace", name)
        deadline = time.monotonic() + 60
        while self.kubectl("get", "sa", "default", "-n", name, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise ClusterError(f"namespace {name}: no default ServiceAccount after 60s")
            time.sleep(0.2)
        return name

    def __repr__(self) -> str:
        server = self._info.get("HEADROOM_KUBE_SERVER", "not up")
        return f"Cluster(name={self.name!r}, server={server!r}, state_dir={str(self.state_dir)!r})"
