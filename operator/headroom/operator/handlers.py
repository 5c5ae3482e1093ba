"""kopf wiring: module-level handlers, each a thin shell around one loop.

- Reconcile (create, spec update, resume, and a change to an owned Deployment that someone
  else made or a Deployment deleted): `reconcile.loop.reconcile`, then its status is server-side
  applied under the reconcile loop's own field manager.
- Scaling: one daemon per InferenceDeployment calls `scaling.loop.tick` every
  `scaling.intervalSeconds` (read from the live object each time) and owns the decision's memory
  between ticks; its status is applied under the scaling loop's field manager. Each loop
  applies only the fields and condition types it owns, so neither can drop the other's.

Persistence: kopf keeps its handler progress and its last-handled configuration in
`status.kopf` (a preserve-unknown-fields stanza of the CRD) rather than in annotations, so the
operator writes nothing but `/status` on the resource, plus one finalizer,
`headroom.dev/finalizer`, which kopf needs to stop a resource's daemon before the object goes
away. Spec is never written: GitOps tools see no drift.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Callable
from functools import partial
from ipaddress import IPv4Address
from typing import Any, cast

import aiohttp
import kopf
from kubernetes.utils import parse_quantity
from pydantic import BaseModel, ConfigDict, Field, IPvAnyAddress, ValidationInfo, field_validator

from headroom.contract.ports import SIDECAR_PORT
from headroom.contract.urls import http_url
from headroom.operator.crd.models import GROUP, HEADROOM_IMAGE, KIND, PLURAL, VERSION
from headroom.operator.kube import Kube, KubeError, owner_of, with_retries
from headroom.operator.observers import watch_listed
from headroom.operator.readiness import READINESS_MANAGER, figures, readiness
from headroom.operator.reconcile.apply_errors import namespace_terminating, permanent_apply_error
from headroom.operator.reconcile.children import SELECTOR_LABEL, Owner, render
from headroom.operator.reconcile.loop import apply_failed, reconcile
from headroom.operator.reconcile.runtimes import DEFAULT_IMAGES, HeadroomImages
from headroom.operator.reconcile.sizing import Parsed, parse
from headroom.operator.scaling.decide import Memory
from headroom.operator.scaling.exporter import OperatorMetrics
from headroom.operator.scaling.loop import rebase_ready, tick
from headroom.operator.scaling.metrics_sources import (
    DEFAULT_RATE_WINDOW,
    MetricsSource,
    PrometheusSource,
    Scrapes,
    SidecarSource,
    client_session,
    rate_window_seconds,
)
from headroom.operator.status import (
    RECONCILE_MANAGER,
    SCALING_MANAGER,
    Outcome,
    get_condition,
    log_fields,
)

log = logging.getLogger("headroom.operator")
FINALIZER = f"{GROUP}/finalizer"
SourceFactory = Callable[[str, "Context"], MetricsSource]
LOOPBACK = IPv4Address("127.0.0.1")
REGISTRY = kopf.OperatorRegistry()
# kopf's root task that ends when the operator is told to stop (its name in kopf 1.3x-1.4x).
STOP_CHECKER = "stop-flag checker"
# Priorities drawn for peering replicas lie below this: an operator started by hand with
# `--priority` at or above it outranks (and pauses) every replica, kopf's way to debug live.
DRAWN_PRIORITIES = 1_000_000_000
# The API groups of the CRDs this operator needs kopf to serve: its own and kopf's peering.
SERVED_GROUPS = (GROUP, "kopf.dev", "zalando.org")


# A namespace pattern as kopf reads it (parts joined by ',', spaces beside a ',' ignored), each
# part a namespace name or a glob that can match one, '!' in front to exclude. The chart's
# values.schema.json has the same expression.
_NS_NAME = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_NS_CLASS = r"\[!?[-a-z0-9]+\]"
_NS_GLOB = rf"([-a-z0-9]|{_NS_CLASS})*([*?]|{_NS_CLASS})([-a-z0-9*?]|{_NS_CLASS})*"
_NS_PART = rf"!?({_NS_NAME}|{_NS_GLOB})"
NAMESPACE_PATTERN = re.compile(rf"{_NS_PART}( *, *{_NS_PART})*")


class Options(BaseModel):
    """`headroom operator` settings."""

    model_config = ConfigDict(extra="forbid")

    namespaces: list[str] = Field(default_factory=list, description="empty: all namespaces")
    kubeconfig: str | None = None
    prometheus_url: str | None = None
    allowed_prometheus_urls: list[str] = Field(
        default_factory=list,
        description="globs a spec's scaling.prometheusURL must match (besides prometheus_url)",
    )
    prometheus_rate_window: str = Field(
        default=DEFAULT_RATE_WINDOW, description="rate() range; at least 4x the scrape interval"
    )
    metrics_port: int = Field(default=8080, ge=0, le=65535, description="0 disables /metrics")
    metrics_host: IPvAnyAddress = Field(default=LOOPBACK, description="/metrics bind address")
    liveness_port: int = Field(default=0, ge=0, le=65535, description="0 disables /healthz")
    liveness_host: IPvAnyAddress = Field(default=LOOPBACK, description="/healthz bind address")
    sidecar_port: int = Field(default=SIDECAR_PORT, ge=1, le=65535)
    peering: str | None = Field(
        default=None, description="kopf peering name for HA; else standalone"
    )
    priority: int | None = Field(
        default=None, ge=0, description="kopf peering priority; None: drawn at startup"
    )
    max_workers: int = Field(default=8, ge=1, le=64)
    resync_seconds: float = Field(
        default=300.0,
        ge=1.0,
        le=86400.0,
        allow_inf_nan=False,
        description="every InferenceDeployment's children are re-applied this often",
    )
    headroom_image: str = Field(
        default=HEADROOM_IMAGE,
        description="the small headroom image REPO:TAG (the sidecar of vLLM and SGLang pods); "
        "runtime headroom's pods run REPO-engine:TAG",
    )

    @field_validator("namespaces")
    @classmethod
    def _namespace_patterns(cls, value: list[str]) -> list[str]:
        # kopf takes names, globs (team-*) and negations (!kube-*), and reads parts joined by
        # ',' as one pattern. One that no namespace can match (an empty one, '-a', an unclosed
        # '[') would watch nothing and say nothing; a plain name gets a Role from the chart.
        for ns in value:
            if not NAMESPACE_PATTERN.fullmatch(ns):
                raise ValueError(
                    f"{ns!r} is not a namespace name or glob: a name is lowercase letters, "
                    "digits and '-', a letter or digit at each end, at most 63 characters; a "
                    "glob has '*', '?' or a closed '[...]'; a leading '!' excludes, and parts "
                    "joined by ',' are one pattern ('team-*,!team-x': each --namespace is "
                    "watched on its own, so an exclusion goes in the same one)"
                )
        return value

    @field_validator("prometheus_url")
    @classmethod
    def _an_http_url(cls, value: str | None) -> str | None:
        # Checked at start: a typo (no scheme) would otherwise fail every scaling tick.
        return None if value is None else http_url(value)

    @field_validator("prometheus_rate_window")
    @classmethod
    def _a_promql_duration(cls, value: str) -> str:
        rate_window_seconds(value)  # ValueError says what is wrong
        return value

    @field_validator("headroom_image")
    @classmethod
    def _a_tagged_image(cls, value: str) -> str:
        HeadroomImages.derive(value)  # ValueError says what is wrong
        return value

    @property
    def images(self) -> HeadroomImages:
        """The images the pods run where an InferenceDeployment names none."""
        return HeadroomImages.derive(self.headroom_image)

    @field_validator("priority")
    @classmethod
    def _only_with_peering(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("peering"):
            raise ValueError("a peering priority needs --peering (standalone has no peers)")
        return value


def peering_priority(options: Options, draw: Callable[[int], int] = secrets.randbelow) -> int:
    """This process's kopf peering priority: the one asked for, else one drawn at startup.

    kopf pauses every operator that sees a live peer of its own priority, so replicas at the
    default 0 would all stand still. Each replica draws its own out of a billion: two tie with
    odds of one in a billion, and a tie is undone by the next restart, which draws again (a
    priority hashed from the pod name would keep the tie, since a container restarts in the
    same pod; drawing also needs nothing from the pod spec). The highest live one works and the
    others stand by; when it stops renewing its peering record (kopf's 60 s lifetime), the next
    highest takes over. The chart sets kopf's identity (POD_ID) to the pod's name, so a
    restarted container replaces its own record rather than waiting behind it. Standalone,
    the priority is never read."""
    if options.priority is not None:
        return options.priority
    return draw(DRAWN_PRIORITIES) if options.peering else 0


class Context:
    """Shared by every handler through kopf's memo: API client, HTTP session, metrics."""

    def __init__(
        self,
        options: Options,
        kube: Kube,
        metrics: OperatorMetrics | None = None,
        source_factory: SourceFactory | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.options = options
        self.kube = kube
        self.metrics = metrics or OperatorMetrics()
        self.source_factory = source_factory
        self.clock = clock
        self.priority = peering_priority(options)  # drawn once: kopf reads it at every event
        self.http: aiohttp.ClientSession | None = None
        # Set the moment the operator starts to exit (SIGTERM, SIGINT, the stop flag), and by
        # the cleanup handler before it closes `http`. kopf stops the daemons it knows of,
        # but a watch event still in a worker can spawn one after that: such a loop must end
        # without a tick, and a loop asleep between ticks must wake.
        self.leaving = asyncio.Event()
        # The last spec generation of each owned Deployment: a newer one that renders
        # differently is drift (kubectl set image, an edit) to undo.
        self.generations: dict[tuple[str, str], int] = {}
        # What each owned Deployment last said of readiness (see `readiness.figures`), once
        # written or found already in the InferenceDeployment's status.
        self.readiness: dict[tuple[str, str], tuple[object, ...]] = {}
        # The Prometheus source's memory of each pod's last scrape, which must outlive the
        # source a tick builds: a scrape read again by the next tick keeps its counters.
        self.scrapes: Scrapes = {}
        # One reconcile at a time per InferenceDeployment, and the newest (uid, generation)
        # each has begun: the resync and the drift repair reconcile a spec read earlier, and a
        # GitOps sync can land meanwhile; the older spec must never be applied after it.
        self.reconciling: dict[tuple[str, str], asyncio.Lock] = {}
        self.reconciled: dict[tuple[str, str], tuple[str, int]] = {}

    @property
    def exiting(self) -> bool:
        """Whether the operator has begun to exit."""
        return self.leaving.is_set()

    def forget_object(self, namespace: str, name: str) -> None:
        """Drop what reconciling one deleted InferenceDeployment left here."""
        self.reconciling.pop((namespace, name), None)
        self.reconciled.pop((namespace, name), None)

    def forget_scrapes(self, namespace: str, name: str) -> None:
        """Drop what the Prometheus source remembers of one InferenceDeployment's pods."""
        for key in [k for k in self.scrapes if k[1:] == (namespace, name)]:
            del self.scrapes[key]

    def source(self, kind: str) -> MetricsSource:
        """The metrics source a spec's `scaling.metricsSource` names."""
        if self.source_factory is not None:
            return self.source_factory(kind, self)
        assert self.http is not None, "the HTTP session opens at operator startup"
        if kind == "prometheus":
            return PrometheusSource(
                self.http,
                self.options.prometheus_url,
                rate_window=self.options.prometheus_rate_window,
                allowed=tuple(self.options.allowed_prometheus_urls),
                scrapes=self.scrapes,
            )
        return SidecarSource(self.http, port=self.options.sidecar_port)


def _ctx(memo: kopf.Memo) -> Context:
    ctx: Context = memo["ctx"]
    return ctx


async def _write(ctx: Context, body: dict[str, Any], outcome: Outcome, manager: str) -> None:
    """Apply the loop's status (its own fields only) and post its Events, each also one
    structured log line. The Events go out even when the status apply fails: they tell of
    what was done (a scale) or refused, and that happened either way."""
    owner = owner_of(body)
    try:
        if outcome.status:
            await asyncio.to_thread(
                with_retries,
                lambda: ctx.kube.apply_status(owner, outcome.status, field_manager=manager),
            )
    finally:
        _post(body, owner, outcome)


# Status applies of a tick made on a resourceVersion before one goes without the precondition.
TICK_GUARDED_WRITES = 2


async def _write_tick(ctx: Context, body: dict[str, Any], outcome: Outcome) -> None:
    """Apply a tick's status, on the resourceVersion of `body`, the object the tick computed
    it from, and post its Events. The tick takes seconds (its scrape), and a reconcile may
    write meanwhile, e.g. Ready=False/ApplyFailed for a new generation: a forced apply would
    write the tick's Ready, read off the previous spec's Deployment, over it, and then no
    one would see the failure until the next resync. On a 409 the object is read again, the
    tick's Ready rebased on it (`rebase_ready`: a reconcile failure, an infeasible or a newer
    generation keeps the Ready it holds) and applied on the new version; after the second
    conflict it goes without the precondition, still rebased on the latest read: the status
    records a decision (a scale already made must reach status.lastDecisions)."""
    owner = owner_of(body)
    status = outcome.status
    version = (body.get("metadata") or {}).get("resourceVersion")
    try:
        if not status:
            return
        for attempt in range(TICK_GUARDED_WRITES + 1):
            guard = version if attempt < TICK_GUARDED_WRITES else None
            try:
                await asyncio.to_thread(
                    with_retries,
                    partial(ctx.kube.apply_status, owner, status, field_manager=SCALING_MANAGER,
                            resource_version=guard),
                    conflicts=guard is None,
                )  # fmt: skip
                return
            except KubeError as exc:
                if guard is None or exc.status != 409:
                    raise
            fresh = await asyncio.to_thread(
                with_retries,
                partial(ctx.kube.get, f"{GROUP}/{VERSION}", KIND, owner.namespace, owner.name),
            )
            if fresh is None:
                return  # deleted meanwhile: nothing to record on
            version = (fresh.get("metadata") or {}).get("resourceVersion")
            status = rebase_ready(outcome.status, body, fresh)
    finally:
        _post(body, owner, outcome)


def _post(body: dict[str, Any], owner: Owner, outcome: Outcome) -> None:
    for ev in outcome.events:
        kopf.event(
            kopf.Body(cast(kopf.RawBody, body)),
            type=ev.type,
            reason=ev.reason,
            message=ev.message[:1024],
        )
        # The object in the text too: the text format prints no extras.
        log.log(
            logging.WARNING if ev.type == "Warning" else logging.INFO,
            "%s/%s: %s: %s",
            owner.namespace,
            owner.name,
            ev.reason,
            ev.message,
            extra={**log_fields(owner.namespace, owner.name), "reason": ev.reason},
        )


async def _reconcile(ctx: Context, body: dict[str, Any]) -> None:
    """Reconcile and write; an apply the API server refuses for good becomes a condition.
    Reconciles of one object run one at a time, and one of a generation older than one
    already begun applies nothing: its children and status would undo the newer spec's."""
    meta = body["metadata"]
    key = (meta.get("namespace") or "", meta["name"])
    stamp = (str(meta.get("uid") or ""), int(meta.get("generation") or 0))
    async with ctx.reconciling.setdefault(key, asyncio.Lock()):
        last = ctx.reconciled.get(key)
        if last is not None and last[0] == stamp[0] and stamp[1] < last[1]:
            log.debug("%s/%s: generation %d is older than %d, already reconciled",
                      key[0], key[1], stamp[1], last[1], extra=log_fields(*key))  # fmt: skip
            return
        ctx.reconciled[key] = stamp
        await _finished_even_if_cancelled(asyncio.create_task(_reconcile_now(ctx, body)))


async def _finished_even_if_cancelled(work: asyncio.Future[None]) -> None:
    """Wait for `work`; cancelled, still wait for it to finish before giving up. The
    worker threads that apply children and write status run on whatever cancels their caller,
    so the object's lock is held until they are done: a newer generation's reconcile beside
    them would be written over."""
    try:
        await asyncio.shield(work)
    except asyncio.CancelledError:
        # Said whenever it ends, a second cancel having cut this wait short or not.
        work.add_done_callback(_log_cancelled_outcome)
        await asyncio.wait({work})  # a second cancel ends this wait
        raise


def _log_cancelled_outcome(work: asyncio.Future[Any]) -> None:
    """How a reconcile whose caller was cancelled ended; a retry later is routine."""
    exc = None if work.cancelled() else work.exception()
    if exc is not None:
        level = logging.DEBUG if isinstance(exc, kopf.TemporaryError) else logging.WARNING
        log.log(level, "a cancelled reconcile ended with: %s", exc)


async def _reconcile_now(ctx: Context, body: dict[str, Any]) -> None:
    try:
        outcome = await asyncio.to_thread(
            reconcile, ctx.kube, body, ctx.clock(), ctx.options.images
        )
    except KubeError as exc:
        meta = body["metadata"]
        if namespace_terminating(exc.status, exc.message):
            # Not a denial: the namespace (and the children with it) is going away.
            log.info("%s/%s: the namespace is being deleted, nothing to apply",
                     meta.get("namespace"), meta.get("name"),
                     extra=log_fields(meta.get("namespace"), meta.get("name")))  # fmt: skip
            return
        ctx.metrics.reconciles.labels("error").inc()
        if not permanent_apply_error(exc.status, exc.message):
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=5) from None
        # The same object would be refused again: say so and wait for the next spec change.
        await _write(ctx, body, apply_failed(body, exc, ctx.clock()), RECONCILE_MANAGER)
        return
    ctx.metrics.reconciles.labels("ok").inc()
    await _write(ctx, body, outcome, RECONCILE_MANAGER)
    # The reconcile wrote Ready from the Deployment as it applied it. Pods that became ready
    # while it ran (seconds, on a fast cluster) were seen by the Deployment watch before this
    # status existed, judged not yet the watch's to say, and their figures recorded: no later
    # event would come to write Ready=True until the next tick. Read it again now.
    meta = body["metadata"]
    await _recheck_readiness(ctx, meta["namespace"], meta["name"])
    if outcome.retry_after is not None:
        ready = get_condition(outcome.status.get("conditions"), "Ready") or {}
        raise kopf.TemporaryError(str(ready.get("message", "")), delay=outcome.retry_after)


@kopf.on.startup(registry=REGISTRY)
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    ctx = _ctx(memo)
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.StatusProgressStorage(
        field="status.kopf.progress", touch_field="status.kopf.dummy"
    )
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(
        field="status.kopf.lastHandledConfiguration"
    )
    settings.posting.level = logging.INFO  # only our explicit kopf.event() calls post
    settings.execution.max_workers = ctx.options.max_workers
    settings.peering.standalone = ctx.options.peering is None
    if ctx.options.peering:
        settings.peering.name = ctx.options.peering
        settings.peering.priority = ctx.priority
        # One ClusterKopfPeering whatever --namespace says (kopf would use a KopfPeering in each
        # watched namespace): one object to create, and namespace globs need none per match.
        settings.peering.clusterwide = True
        log.info("peering %r at priority %d", ctx.options.peering, ctx.priority)
    ctx.http = client_session()
    _hear_the_stop(ctx)


def _hear_the_stop(ctx: Context) -> None:
    """Mark `ctx` exiting when kopf's stop-flag checker ends, which it does on SIGTERM, SIGINT
    or the stop flag, before kopf cancels anything: the cleanup handler comes only after kopf
    has stopped the daemons it knows of and waited for its other tasks."""
    checker = next((t for t in asyncio.all_tasks() if t.get_name() == STOP_CHECKER), None)
    if checker is None:  # another kopf release: the cleanup handler still marks it
        log.debug("no %r task: the exit is heard at cleanup", STOP_CHECKER)
        return
    checker.add_done_callback(lambda _: ctx.leaving.set())


@kopf.on.cleanup(registry=REGISTRY)
async def close(memo: kopf.Memo, **_: Any) -> None:
    ctx = _ctx(memo)
    ctx.leaving.set()
    if ctx.http is not None:
        await ctx.http.close()


@kopf.on.login(registry=REGISTRY)
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    return connection_info(_ctx(memo).kube)


@kopf.on.resume(GROUP, VERSION, PLURAL, backoff=5, registry=REGISTRY)
@kopf.on.create(GROUP, VERSION, PLURAL, backoff=5, registry=REGISTRY)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", backoff=5, registry=REGISTRY)
async def reconcile_children(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _reconcile(_ctx(memo), dict(body))


async def _pause(ctx: Context, stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Sleep `seconds`, less if the daemon is stopped or the operator exits. Not
    `stopped.wait(seconds)`: its timer is a task of its own, which kopf, waiting for its hung
    tasks at exit, finds ended in TimeoutError and raises out of the whole operator."""

    async def until_stopped() -> None:
        await stopped.wait()

    waiters = [asyncio.create_task(until_stopped()), asyncio.create_task(ctx.leaving.wait())]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


# A tick in flight gets DAEMON_GRACE seconds to finish when kopf stops its daemon (exit, a
# peering pause): cancelled between its scale and its status write, the scale would stand with
# no decision recorded, and the next operator would scale again inside the stabilization
# window. Grace plus kopf's cancellation timeout stays under the pod's 30 s termination grace.
DAEMON_GRACE = 5.0


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=DAEMON_GRACE, cancellation_timeout=10,
             registry=REGISTRY)  # fmt: skip
async def scale(body: kopf.Body, stopped: kopf.DaemonStopped, memo: kopf.Memo, **_: Any) -> None:
    """The scaling loop of one InferenceDeployment: a decision every intervalSeconds, and
    the decision's memory, owned here and nowhere else."""
    ctx = _ctx(memo)
    memory: Memory | None = None
    ns, name = body["metadata"].get("namespace") or "", body["metadata"]["name"]
    try:
        # A loop that never completes a tick must still show as stalled: its clock starts now.
        ctx.metrics.ticked(ns, name, ctx.clock())
        while not stopped and not ctx.exiting:
            live = dict(body)  # the latest the watch has seen, parsed once per decision
            parsed = parse(live.get("spec"))
            interval = parsed.spec.scaling.interval_seconds if parsed.spec else 60
            # Before the tick: a spec change of the interval moves the stall alert's threshold
            # even while ticks fail.
            ctx.metrics.due(ns, name, interval)
            memory = await _tick(ctx, live, parsed, memory, stopped)
            await _pause(ctx, stopped, interval)
    finally:
        # Whatever ends the loop (deleted, this replica paused for a peer with priority, the
        # operator exiting), its last decision must not stay on /metrics as a frozen series
        # beside the active replica's live one.
        ctx.metrics.forget(ns, name)
        ctx.forget_scrapes(ns, name)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=DAEMON_GRACE, cancellation_timeout=10,
             registry=REGISTRY)  # fmt: skip
async def resync(body: kopf.Body, stopped: kopf.DaemonStopped, memo: kopf.Memo, **_: Any) -> None:
    """Re-apply the children every --resync-seconds: a deleted Service or PodDisruptionBudget
    (only Deployments are watched) or monitoring CRDs installed later are seen by no event.
    Server-side apply of what is already there writes nothing."""
    ctx = _ctx(memo)
    while not stopped and not ctx.exiting:
        await _pause(ctx, stopped, ctx.options.resync_seconds)
        live = dict(body)
        ready = get_condition((live.get("status") or {}).get("conditions"), "Ready") or {}
        # A refused apply waits for the next spec change: retrying it would only repeat the
        # ApplyFailed Event.
        refused = ready.get("reason") == "ApplyFailed"
        if stopped or ctx.exiting or live["metadata"].get("deletionTimestamp") or refused:
            continue
        try:
            await _reconcile(ctx, live)
        except kopf.TemporaryError as exc:
            meta = live["metadata"]
            log.warning("re-applying %s/%s: %s", meta["namespace"], meta["name"], exc,
                        extra=log_fields(meta["namespace"], meta["name"]))  # fmt: skip


async def _tick(
    ctx: Context,
    body: dict[str, Any],
    parsed: Parsed,
    memory: Memory | None,
    stopped: kopf.DaemonStopped | None = None,
) -> Memory | None:
    meta = body["metadata"]
    about = log_fields(meta["namespace"], meta["name"])

    def record(failures: list[str]) -> None:
        """The stall alert's series. Not once stopped (deleted while the tick ran): kopf stops
        the daemon, then runs `forget`, which may already have dropped what this brings back."""
        if stopped:
            return
        for stage in failures:
            ctx.metrics.failed(meta["namespace"], meta["name"], stage)
        if not failures:
            ctx.metrics.ticked(meta["namespace"], meta["name"], ctx.clock())

    if parsed.spec is None:
        record([])  # nothing it may scale, as for a spec that cannot be sized: Ready says why
        return memory
    try:
        source = ctx.source(parsed.spec.scaling.metrics_source)
        result = await tick(ctx.kube, source, body, parsed, ctx.clock(), memory)
    except KubeError as exc:
        # One line, no traceback: the API server is down or refusing; the next tick retries.
        log.warning("scaling %s/%s: %s", meta["namespace"], meta["name"], exc, extra=about)
        record(["api"])
        return memory
    except Exception:
        if ctx.exiting:
            # The operator closed the HTTP session under a tick in flight: not a failure.
            log.debug("scaling %s/%s: operator exiting", meta["namespace"], meta["name"],
                      extra=about)  # fmt: skip
            return memory
        # A bug in one tick must not end the loop: kopf would restart the daemon after its
        # backoff with the decision memory lost. Logged with the traceback; the next tick runs.
        log.exception("scaling %s/%s: the decision failed", meta["namespace"], meta["name"],
                      extra=about)  # fmt: skip
        record(["error"])
        return memory
    # From here the decision stands (and in auto mode its scale is applied): a status write
    # that fails must not hand the next tick the old memory, which would forget the scale and
    # its stabilization window and scale again.
    failures = [result.failure] if result.failure else []
    try:
        await _write_tick(ctx, body, result.outcome)
    except KubeError as exc:
        failures.append("status")
        log.warning("scaling %s/%s: status not written: %s", meta["namespace"], meta["name"],
                    exc, extra=about)  # fmt: skip
    except Exception:
        failures.append("status")
        log.exception("scaling %s/%s: status not written", meta["namespace"], meta["name"],
                      extra=about)  # fmt: skip
    record(failures)
    if "status" not in failures:
        # The tick wrote Ready from the Deployment it read before its scrape (seconds ago): a
        # readiness change the watch wrote meanwhile was overwritten. Read it again and repair.
        await _recheck_readiness(ctx, meta["namespace"], meta["name"])
    if stopped:
        return result.memory
    if result.decision is not None and result.current is not None:
        d = result.decision
        ctx.metrics.publish(meta["namespace"], meta["name"], result.mode, d.replicas,
                            result.current)  # fmt: skip
        if d.action != "hold":
            ctx.metrics.decided(meta["namespace"], meta["name"], d.action, d.reason)
    return result.memory


@kopf.on.event("apps", "v1", "deployments", labels={SELECTOR_LABEL: kopf.PRESENT},
               registry=REGISTRY)  # fmt: skip
async def owned_deployment(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Undo what someone else did to a Deployment this operator owns: re-create it when
    deleted, re-apply it when its spec drifted from what the spec renders. A change of its
    readiness goes to the InferenceDeployment's Ready and replica counts at once."""
    ctx = _ctx(memo)
    obj: dict[str, Any] = dict(event["object"])
    meta: dict[str, Any] = obj.get("metadata", {})
    key = (meta.get("namespace", ""), meta.get("name", ""))
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("kind") == KIND), None)
    if owner is None:
        return
    if event["type"] == "DELETED":
        ctx.generations.pop(key, None)
        ctx.readiness.pop(key, None)
    else:
        generation = int(meta.get("generation") or 0)
        seen = ctx.generations.get(key)
        ctx.generations[key] = generation
        if seen is None or generation <= seen:
            # First sight (the resume handler reconciles) or no spec change.
            if seen is not None and not ctx.exiting:
                await _refresh_readiness(ctx, key, owner["name"], obj)
            return
    body = await asyncio.to_thread(ctx.kube.get, f"{GROUP}/{VERSION}", KIND, key[0], owner["name"])
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    if event["type"] != "DELETED" and not _drifted(body, obj, ctx.options.images):
        return
    log.info(
        "%s %s/%s: re-applying the children",
        "deleted" if event["type"] == "DELETED" else "drifted", key[0], key[1],
        extra=log_fields(key[0], owner["name"]),
    )  # fmt: skip
    try:
        await _reconcile(ctx, body)
    except kopf.TemporaryError as exc:
        log.warning("re-applying %s/%s: %s", key[0], owner["name"], exc,
                    extra=log_fields(key[0], owner["name"]))  # fmt: skip


async def _refresh_readiness(
    ctx: Context, key: tuple[str, str], owner: str, deployment: dict[str, Any]
) -> None:
    """Write Ready and the replica counts the Deployment's status now implies, if they moved
    (`headroom.operator.readiness`). The write carries the InferenceDeployment's version as
    read: one that meets a newer object (a reconcile or a tick wrote in between) is read and
    judged again, once; a tick repairs what it overwrote (`_recheck_readiness`)."""
    now_figures = figures(deployment)
    if ctx.readiness.get(key) == now_figures:
        return
    for attempt in range(2):
        body = await asyncio.to_thread(ctx.kube.get, f"{GROUP}/{VERSION}", KIND, key[0], owner)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        outcome = readiness(body, deployment, ctx.clock())
        if outcome is None:
            break
        version = body["metadata"].get("resourceVersion")
        try:
            await asyncio.to_thread(
                with_retries,
                partial(ctx.kube.apply_status, owner_of(body), outcome.status,
                        field_manager=READINESS_MANAGER, resource_version=version),
                conflicts=False,
            )  # fmt: skip
            break
        except KubeError as exc:
            log.debug("readiness of %s/%s not written: %s", key[0], owner, exc,
                      extra=log_fields(key[0], owner))  # fmt: skip
            if exc.status != 409 or attempt:
                return
    ctx.readiness[key] = now_figures


async def _recheck_readiness(ctx: Context, namespace: str, name: str) -> None:
    """After a tick's status write: Ready and the counts from the Deployment as it is now."""
    if ctx.exiting:
        return
    try:
        live = await asyncio.to_thread(ctx.kube.get, "apps/v1", "Deployment", namespace, name)
        if live is not None:
            ctx.readiness.pop((namespace, name), None)
            await _refresh_readiness(ctx, (namespace, name), name, live)
    except KubeError as exc:
        log.debug("readiness of %s/%s not rechecked: %s", namespace, name, exc,
                  extra=log_fields(namespace, name))  # fmt: skip


def _drifted(
    body: dict[str, Any], live: dict[str, Any], images: HeadroomImages = DEFAULT_IMAGES
) -> bool:
    """Whether the live Deployment no longer holds what the spec renders for it (with the
    images the reconcile applies: any others would be drift at every event)."""
    parsed = parse(body.get("spec"))
    if parsed.spec is None or parsed.sizing is None or not parsed.sizing.feasible:
        return False
    want = next(
        o
        for o in render(owner_of(body), parsed.spec, parsed.sizing, None, images=images)
        if o["kind"] == "Deployment"
    )
    return not _contains(live.get("spec", {}), want.get("spec", {}))


def _contains(live: Any, want: Any) -> bool:
    """`want` is a part of `live`: every field it sets has the same value there (the server
    adds defaults, so extra fields in `live` are fine)."""
    if isinstance(want, dict):
        return isinstance(live, dict) and all(
            k in live and _contains(live[k], v) for k, v in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(live, list)
            and len(live) == len(want)
            and all(_contains(a, b) for a, b in zip(live, want, strict=True))
        )
    if live == want or str(live) == str(want):
        return True
    # The server stores quantities canonically (32768Mi as 32Gi): the same amount is no drift,
    # or every scale of the Deployment would re-apply its children.
    try:
        return bool(parse_quantity(live) == parse_quantity(want))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError):
        return False


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, registry=REGISTRY)
def forget(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    _ctx(memo).metrics.forget(namespace or "", name)
    _ctx(memo).forget_object(namespace or "", name)


def connection_info(kube: Kube) -> kopf.ConnectionInfo:
    """kopf's credentials from the same configuration the operator's own client uses."""
    cfg = kube.configuration
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
        "authorization"
    )
    parts = header.split(" ", 1) if header else []
    scheme, token = (
        (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    )
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


async def operate(
    options: Options,
    *,
    kube: Kube | None = None,
    metrics: OperatorMetrics | None = None,
    source_factory: SourceFactory | None = None,
    stop_flag: Any = None,
    ready_flag: Any = None,
) -> None:
    """Run the operator until `stop_flag` is set (or a signal arrives in the main thread)."""
    kube = kube or Kube.connect(options.kubeconfig)
    ctx = Context(options, kube, metrics, source_factory)
    host = options.liveness_host
    at = f"[{host}]" if host.version == 6 else str(host)
    liveness = f"http://{at}:{options.liveness_port}/healthz" if options.liveness_port else None
    watch_listed(SERVED_GROUPS)
    await kopf.operator(
        registry=REGISTRY,
        memo=kopf.Memo(ctx=ctx),
        clusterwide=not options.namespaces,
        namespaces=options.namespaces,
        standalone=options.peering is None,
        peering_name=options.peering,
        priority=ctx.priority,
        liveness_endpoint=liveness,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
