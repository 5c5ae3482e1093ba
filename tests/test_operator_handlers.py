"""The kopf handlers' shells: peering settings, and what a scaling tick writes when the API
refuses part of it (the loops themselves: test_operator_reconcile.py)."""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import kopf
import pytest
from kopf._core.actions.loggers import ObjectLogger
from test_operator_reconcile import NOW, SPEC, FakeKube, FakeSource, created, pods

import headroom.operator.handlers as handlers
from headroom.operator.cli import configure_logging
from headroom.operator.handlers import (
    DRAWN_PRIORITIES,
    Context,
    Options,
    _post,
    _tick,
    configure,
    peering_priority,
)
from headroom.operator.kube import KubeError, owner_of
from headroom.operator.reconcile.sizing import parse
from headroom.operator.scaling.exporter import TICK_FAILURE_STAGES as STAGES
from headroom.operator.scaling.metrics_sources import (
    PrometheusSource,
    SidecarSource,
    client_session,
)
from headroom.operator.status import SCALING_MANAGER, Event, Outcome, get_condition

# ----------------------------------------------------------------------------- peering


async def _configured(options: Options) -> tuple[Context, kopf.OperatorSettings]:
    settings = kopf.OperatorSettings()
    ctx = Context(options, kube=None)  # type: ignore[arg-type]
    await configure(settings=settings, memo=kopf.Memo(ctx=ctx))
    assert ctx.http is not None
    await ctx.http.close()
    return ctx, settings


async def _paused(me: str, settings: kopf.OperatorSettings, peers: dict[str, int]) -> bool:
    """Whether kopf's own peering logic pauses the operator `me` among `peers` (all alive)."""
    from kopf._cogs.aiokits import aiotoggles
    from kopf._core.engines import peering

    settings.peering.mandatory = True  # what kopf.operator(peering_name=...) adds
    now = datetime.datetime.now(datetime.UTC).isoformat()
    status = {who: {"priority": p, "lifetime": 60, "lastseen": now} for who, p in peers.items()}
    raw = {"type": "MODIFIED", "object": {"metadata": {"name": settings.peering.name},
                                          "status": status}}  # fmt: skip
    paused = aiotoggles.Toggle(False)
    pressure = asyncio.Event()
    pressure.set()
    await peering.process_peering_event(
        raw_event=raw, namespace=None, resource=None, identity=peering.Identity(me),  # type: ignore[arg-type]
        settings=settings, autoclean=False, stream_pressure=pressure, conflicts_found=paused,
    )  # fmt: skip
    return paused.is_on()


async def test_peering_replicas_get_distinct_priorities_so_kopf_runs_the_highest() -> None:
    # kopf pauses every operator that sees a live peer of its own priority: two replicas at
    # the default 0 would both stand still.
    (a, sa), (b, sb) = [await _configured(Options(peering="headroom")) for _ in range(2)]
    assert sa.peering.priority == a.priority and sb.peering.priority == b.priority
    assert a.priority != b.priority
    assert 0 <= min(a.priority, b.priority) < DRAWN_PRIORITIES
    peers = {"pod-a": a.priority, "pod-b": b.priority}
    paused = [await _paused("pod-a", sa, peers), await _paused("pod-b", sb, peers)]
    # One works, the other stands by.
    assert sorted(paused) == [False, True]
    assert paused[0] == (a.priority < b.priority)
    # Peering is cluster-wide also for an operator of a few namespaces: one object to create.
    _, sn = await _configured(Options(peering="headroom", namespaces=["team-a"]))
    assert sn.peering.clusterwide and sn.peering.name == "headroom"


async def test_an_explicit_priority_wins_and_standalone_needs_none() -> None:
    ctx, settings = await _configured(Options(peering="p", priority=7))
    assert ctx.priority == settings.peering.priority == 7
    assert peering_priority(Options(peering="p"), draw=lambda n: n - 1) == DRAWN_PRIORITIES - 1
    assert peering_priority(Options()) == 0
    _, settings = await _configured(Options())
    assert settings.peering.standalone
    with pytest.raises(ValueError, match="needs --peering"):
        Options(priority=3)


# ----------------------------------------------------------------------------- scaling tick


class Daemon:
    """A kopf daemon handler running as kopf runs it, until `stop()` says why it ends."""

    def __init__(self, handler: Any, ctx: Context, body: dict[str, Any]) -> None:
        from kopf._cogs.aiokits import aioenums

        self.setter: aioenums.FlagSetter[Any] = aioenums.FlagSetter()
        self.task = asyncio.create_task(
            handler(body=kopf.Body(body), stopped=aioenums.AsyncFlagWaiter(self.setter),
                    memo=kopf.Memo(ctx=ctx))
        )  # fmt: skip

    async def stop(self, reason: str) -> None:
        from kopf._core.intents import stoppers

        self.setter.set(getattr(stoppers.DaemonStoppingReason, reason))
        await asyncio.wait_for(self.task, 5)


@pytest.mark.parametrize("reason", ["OPERATOR_PAUSING", "RESOURCE_DELETED"])
async def test_a_stopped_scaling_loop_leaves_no_frozen_series_on_metrics(
    posted: list[tuple[str, str, str]], reason: str
) -> None:
    # A replica kopf pauses for a peer of higher priority keeps serving /metrics: its last
    # decision must not stand there beside the active replica's live one.
    kube, b = await created({**SPEC, "scaling": {"mode": "advisory", "intervalSeconds": 1}})
    ctx = Context(Options(), kube, source_factory=lambda k, c: FakeSource(0.95, arrivals=2.0))
    ctx.clock = lambda: NOW
    labels = {"namespace": "ns", "inferencedeployment": "chat", "mode": "advisory"}
    daemon = Daemon(handlers.scale, ctx, b)
    for _ in range(100):
        if ctx.metrics.registry.get_sample_value("headroom_desired_replicas", labels):
            break
        await asyncio.sleep(0.05)
    assert ctx.metrics.registry.get_sample_value("headroom_desired_replicas", labels)
    await daemon.stop(reason)
    assert ctx.metrics.registry.get_sample_value("headroom_desired_replicas", labels) is None


@pytest.mark.parametrize("reason", ["Available", "ApplyFailed"])
async def test_the_resync_re_applies_unless_the_last_apply_was_refused_for_good(
    posted: list[tuple[str, str, str]], reason: str
) -> None:
    # A refused apply waits for the next spec change: resyncing it would only repeat its Event.
    kube, b = await created(SPEC)
    b["status"]["conditions"] = [{"type": "Ready", "status": "False", "reason": reason}]
    before = len(kube.applies)
    daemon = Daemon(handlers.resync, Context(Options(resync_seconds=1.0), kube), b)
    # Bounded waits, not one fixed sleep: a pause of the loop (a GC pass on a loaded CI
    # machine) could otherwise land the stop before the first resync.
    for _ in range(100 if reason == "Available" else 25):  # 10 s, or 2.5 s: two resyncs
        if len(kube.applies) > before:
            break
        await asyncio.sleep(0.1)
    await daemon.stop("OPERATOR_EXITING")
    assert (len(kube.applies) > before) is (reason != "ApplyFailed")


class SessionSource:
    """Polls through the operator's own HTTP session (loopback), once `go` is set."""

    def __init__(self, ctx: Context) -> None:
        self.ctx, self.calls = ctx, 0
        self.entered, self.go = asyncio.Event(), asyncio.Event()

    async def sample(self, *args: object) -> Any:
        self.calls += 1
        self.entered.set()
        await self.go.wait()
        assert self.ctx.http is not None
        async with self.ctx.http.get("http://127.0.0.1:9/saturation"):
            raise AssertionError("the session was open")


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def _session_rig() -> tuple[FakeKube, dict[str, Any], Context, SessionSource]:
    """A deployment whose ticks poll through the operator's own (open) HTTP session."""
    kube, b = await created({**SPEC, "scaling": {"intervalSeconds": 1}})
    ctx = Context(Options(), kube)
    source = SessionSource(ctx)
    ctx.source_factory = lambda kind, c: source
    ctx.http = client_session()
    return kube, b, ctx, source


async def test_a_scaling_loop_spawned_while_the_operator_exits_ticks_nothing(
    posted: list[tuple[str, str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    # kopf runs the cleanup handler, which closes the HTTP session, once its root tasks are
    # done; a watch event still in a worker can spawn a daemon after the daemon killer stopped
    # them all. Its first tick hit the closed session: a traceback on a graceful exit (CI).
    kube, b, ctx, source = await _session_rig()
    await handlers.close(memo=kopf.Memo(ctx=ctx))
    source.go.set()
    for handler in (handlers.scale, handlers.resync):
        daemon = Daemon(handler, ctx, b)
        await asyncio.sleep(0.3)
        assert daemon.task.done()  # it ended by itself, no stop needed
    assert source.calls == 0 and kube.statuses == [] and _errors(caplog) == []


async def test_a_tick_in_flight_when_the_operator_closes_its_session_is_no_failure(
    posted: list[tuple[str, str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    kube, b, ctx, source = await _session_rig()
    daemon = Daemon(handlers.scale, ctx, b)
    await asyncio.wait_for(source.entered.wait(), 5)
    await handlers.close(memo=kopf.Memo(ctx=ctx))
    source.go.set()
    await asyncio.wait_for(daemon.task, 5)  # the loop ends with the operator
    assert source.calls == 1 and kube.statuses == [] and _errors(caplog) == []


async def _kopf_stops(daemon: Daemon, handler: Any, reason: str) -> None:
    """kopf's own stop of a daemon (exit, a peering pause), with the handler's registered
    cancellation backoff and timeout."""
    from kopf._core.engines import daemons
    from kopf._core.intents import stoppers

    registered = next(h for h in handlers.REGISTRY._spawning.get_all_handlers()
                      if h.fn is handler)  # fmt: skip
    kd = daemons.Daemon(task=daemon.task, logger=logging.getLogger("kopf"), handler=registered,
                        stopper=daemon.setter)  # fmt: skip
    await daemons.stop_daemon(settings=kopf.OperatorSettings(), daemon=kd,
                              reason=getattr(stoppers.DaemonStoppingReason, reason))  # fmt: skip


@pytest.mark.parametrize("reason", ["OPERATOR_EXITING", "OPERATOR_PAUSING"])
async def test_a_scale_in_flight_when_kopf_stops_the_loop_is_recorded(
    posted: list[tuple[str, str, str]], reason: str
) -> None:
    # kopf cancelled the daemon at once (no cancellation backoff): the PATCH went through in
    # its worker thread but the status never said so, and the next operator (a restart, the
    # peer taking over) scaled again inside scaleUpStabilizationSeconds.
    import threading

    kube, b = await created({**SPEC, "scaling": {"scaleUpStabilizationSeconds": 600}})
    started, scale = threading.Event(), kube.scale

    def slow_scale(*args: Any, **kwargs: Any) -> int:
        started.set()
        threading.Event().wait(0.5)  # a slow API answer
        return scale(*args, **kwargs)

    kube.scale = slow_scale  # type: ignore[method-assign]
    ctx = Context(Options(), kube, source_factory=lambda k, c: FakeSource(0.97, arrivals=3.0))
    ctx.clock = lambda: NOW
    daemon = Daemon(handlers.scale, ctx, b)
    assert await asyncio.to_thread(started.wait, 5)
    await _kopf_stops(daemon, handlers.scale, reason)
    assert daemon.task.done() and not daemon.task.cancelled()
    ((_, replicas, _),) = kube.scales
    ((_, status),) = kube.statuses
    assert status["replicas"] == replicas and status["lastDecisions"][0]["to"] == replicas


async def test_a_loop_asleep_wakes_when_the_operator_starts_to_exit(
    posted: list[tuple[str, str, str]],
) -> None:
    # A loop kopf does not know to stop (spawned after its daemon killer ran) slept through
    # its interval, 300 s for the resync; kopf cancelled it as a hung task 5 s later, and the
    # sleep's own timer task, found ended in TimeoutError, was raised out of the operator:
    # exit 1 with the empty line "headroom operator: ".
    kube, b = await created({**SPEC, "scaling": {"intervalSeconds": 600}})
    ctx = Context(Options(), kube, source_factory=lambda k, c: FakeSource(0.5, arrivals=1.0))
    ctx.clock = lambda: NOW
    loops = [Daemon(handlers.scale, ctx, b), Daemon(handlers.resync, ctx, b)]
    for _ in range(100):
        if kube.statuses:
            break
        await asyncio.sleep(0.05)
    assert len(kube.statuses) == 1  # the scaling loop's first tick, then asleep
    ctx.leaving.set()
    await asyncio.wait_for(asyncio.gather(*(d.task for d in loops)), 5)
    assert len(kube.statuses) == 1
    assert not [t for t in asyncio.all_tasks() if "daemon stopper" in t.get_name()]


async def test_the_operator_hears_the_stop_before_kopf_cancels_anything() -> None:
    import inspect

    from kopf._core.reactor import running

    # The task kopf ends on SIGTERM, SIGINT or its stop flag goes by this name in the kopf
    # the lock installs.
    assert f'name="{handlers.STOP_CHECKER}"' in inspect.getsource(running.spawn_tasks)
    ctx = Context(Options(), kube=None)  # type: ignore[arg-type]
    signal = asyncio.get_running_loop().create_future()

    async def checker() -> None:
        await signal

    task = asyncio.create_task(checker(), name=handlers.STOP_CHECKER)
    handlers._hear_the_stop(ctx)
    await asyncio.sleep(0)
    assert not ctx.exiting
    signal.set_result(None)
    await task
    await asyncio.sleep(0)
    assert ctx.exiting


async def test_a_scale_whose_status_write_fails_is_remembered_and_its_events_posted(
    posted: list[tuple[str, str, str]],
) -> None:
    spec = {**SPEC, "scaling": {"scaleUpStabilizationSeconds": 300, "maxScaleUpPods": 1}}
    kube, b = await created(spec)

    def refused(*args: object, **kwargs: object) -> None:
        raise KubeError(422, "Invalid", "status.kv: Invalid value")

    kube.apply_status = refused  # type: ignore[method-assign,assignment]
    ctx = Context(Options(), kube, source_factory=lambda kind, c: FakeSource(0.6, arrivals=3.0))  # type: ignore[arg-type,return-value]
    ctx.clock = lambda: NOW
    memory = await _tick(ctx, b, parse(b["spec"]), None)
    assert kube.scales == [("chat", 5, SCALING_MANAGER)]
    # The scale happened: its memory goes on, and its Event says so though status could not.
    assert memory is not None and memory.last_up == NOW
    assert ("Normal", "ScaledOut") in [(t, r) for t, r, _ in posted]
    # 15 s later the up-stabilization window still holds: no second scale-out.
    kube.pods = pods(4, 1)
    ctx.clock = lambda: NOW + 15
    await _tick(ctx, b, parse(b["spec"]), memory)
    assert kube.scales == [("chat", 5, SCALING_MANAGER)]


async def test_a_refused_scale_is_a_warning_and_a_condition_not_a_lost_tick(
    posted: list[tuple[str, str, str]],
) -> None:
    kube, b = await created(SPEC)
    kube.fail = [KubeError(403, "Forbidden", 'cannot patch resource "deployments/scale"')]
    ctx = Context(Options(), kube, source_factory=lambda kind, c: FakeSource(0.6, arrivals=3.0))  # type: ignore[arg-type,return-value]
    ctx.clock = lambda: NOW
    memory = await _tick(ctx, b, parse(b["spec"]), None)
    assert kube.scales == []
    ((kind, _, message),) = [e for e in posted if e[1] == "ScaleFailed"]
    assert kind == "Warning" and "4 -> " in message and "403" in message
    ((manager, status),) = kube.statuses
    assert manager == SCALING_MANAGER and status["replicas"] == 4
    limited = get_condition(status["conditions"], "ScalingLimited")
    assert limited is not None and limited["reason"] == "ScaleFailed"
    assert "deployments/scale" in limited["message"]
    # Nothing changed, so nothing starts a stabilization window.
    assert memory is not None and memory.last_up is None


def _tick_series(ctx: Context) -> dict[str, float | None]:
    """The stall alert's series of ns/chat: last tick, interval, and failures by stage."""
    chat = {"namespace": "ns", "inferencedeployment": "chat"}
    get = ctx.metrics.registry.get_sample_value
    out = {
        "last": get("headroom_scaling_last_tick_timestamp_seconds", chat),
        "interval": get("headroom_scaling_interval_seconds", chat),
    }
    for stage in STAGES:
        out[stage] = get("headroom_scaling_tick_failures_total", {**chat, "stage": stage})
    return out


async def test_a_tick_that_fails_counts_its_stage_and_leaves_the_last_tick_where_it_was(
    posted: list[tuple[str, str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loop failing every tick changed no series: the operator's /metrics looked healthy
    # while nothing was scaled. The stall alert reads the last completed tick's time.
    kube, b = await created(SPEC)
    source = FakeSource(0.6, arrivals=3.0)
    ctx = Context(Options(), kube, source_factory=lambda kind, c: source)  # type: ignore[arg-type,return-value]
    clock = [NOW]
    ctx.clock = lambda: clock[0]
    memory = await _tick(ctx, b, parse(b["spec"]), None)
    assert len(kube.scales) == 1
    done = {"last": NOW, "interval": None} | dict.fromkeys(STAGES)
    assert _tick_series(ctx) == done
    # The API server refusing the tick, a bug, the metrics source down, the scale refused
    # (the decision and its status stand: ScaleFailed), the status write refused.
    clock[0] += 20
    real = handlers.tick
    for exc in (KubeError(503, "ServiceUnavailable", "etcd leader changed"), RuntimeError()):
        monkeypatch.setattr(handlers, "tick", _raising(exc))
        await _tick(ctx, b, parse(b["spec"]), memory)
    monkeypatch.setattr(handlers, "tick", real)
    source.fail = True
    await _tick(ctx, b, parse(b["spec"]), memory)
    source.fail = False
    kube.pods = pods(5, 0)
    source.occupancy = 0.99
    kube.fail = [KubeError(403, "Forbidden", 'cannot patch resource "deployments/scale"')]
    await _tick(ctx, b, parse(b["spec"]), memory)
    assert len(kube.scales) == 1
    assert [r for _, r, _ in posted].count("ScaleFailed") == 1

    def refused(*args: object, **kwargs: object) -> None:
        raise KubeError(422, "Invalid", "status.kv: Invalid value")

    kube.apply_status = refused  # type: ignore[method-assign,assignment]
    await _tick(ctx, b, parse(b["spec"]), memory)
    assert _tick_series(ctx) == done | dict.fromkeys(STAGES, 1.0)
    # A spec the operator cannot read has nothing it may scale: Ready says why, not this.
    await _tick(ctx, b, parse({"model": {"preset": 5}}), memory)
    assert _tick_series(ctx)["last"] == NOW + 20
    # An operator exiting under a tick in flight is no failure.
    monkeypatch.setattr(handlers, "tick", _raising(RuntimeError()))
    ctx.leaving.set()
    await _tick(ctx, b, parse(b["spec"]), memory)
    assert _tick_series(ctx) == done | dict.fromkeys(STAGES, 1.0) | {"last": NOW + 20}


def _raising(exc: Exception) -> Callable[..., Any]:
    async def raising(*args: object, **kwargs: object) -> None:
        raise exc

    return raising


async def test_a_loop_that_never_completes_a_tick_counts_from_its_start_and_forgets_on_stop(
    posted: list[tuple[str, str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    kube, b = await created({**SPEC, "scaling": {"intervalSeconds": 1}})
    monkeypatch.setattr(handlers, "tick", _raising(KubeError(403, "Forbidden", "no")))
    ctx = Context(Options(), kube, source_factory=lambda k, c: FakeSource(0.6, arrivals=3.0))
    ctx.clock = lambda: NOW
    daemon = Daemon(handlers.scale, ctx, b)
    for _ in range(100):
        if (_tick_series(ctx)["api"] or 0) >= 2:
            break
        await asyncio.sleep(0.05)
    series = _tick_series(ctx)
    assert (series["api"] or 0) >= 2
    assert (series["last"], series["interval"]) == (NOW, 1.0)
    # A new interval moves the alert's threshold though every tick still fails.
    b["spec"] = {**b["spec"], "scaling": {"intervalSeconds": 2}}
    for _ in range(100):
        if _tick_series(ctx)["interval"] == 2.0:
            break
        await asyncio.sleep(0.05)
    assert _tick_series(ctx)["interval"] == 2.0 and _tick_series(ctx)["last"] == NOW
    await daemon.stop("RESOURCE_DELETED")
    assert set(_tick_series(ctx).values()) == {None}


# ----------------------------------------------------------------------------- logs


QUIETED = ("kopf", "aiohttp.access")


def _log_lines(
    capsys: pytest.CaptureFixture[str],
    json_format: bool,
    emit: Callable[[], None],
    verbose: bool = False,
) -> list[str]:
    """What the operator's own log handler prints (stderr) for the records `emit` logs."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, [logging.getLogger(n).level for n in QUIETED])
    try:
        configure_logging(verbose=verbose, json_format=json_format)
        emit()
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        for name, level in zip(QUIETED, saved[2], strict=True):
            logging.getLogger(name).setLevel(level)
    return capsys.readouterr().err.splitlines()


def test_the_liveness_probe_is_not_a_log_line_unless_verbose(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # kopf's /healthz server is aiohttp: its access log printed a line for every kubelet probe.
    def emit() -> None:
        logging.getLogger("aiohttp.access").info('127.0.0.1 "GET /healthz HTTP/1.1" 200')
        logging.getLogger("aiohttp.access").warning("a warning still shows")

    assert [line for line in _log_lines(capsys, False, emit) if "healthz" in line] == []
    assert len(_log_lines(capsys, False, emit)) == 1
    assert len(_log_lines(capsys, False, emit, verbose=True)) == 2


def test_kopf_lines_about_an_object_name_it_in_text_logs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # kopf.configure's log_prefix defaulted to False: "Handler 'reconcile_children' failed
    # temporarily: ..." named no namespace or InferenceDeployment.
    body = kopf.Body({"metadata": {"namespace": "team-a", "name": "llama"}})  # type: ignore[arg-type]
    logger = ObjectLogger(body=body, settings=kopf.OperatorSettings())

    def emit() -> None:
        logger.error("Handler 'reconcile_children' failed temporarily: 503")

    (line,) = _log_lines(capsys, False, emit)
    assert "[team-a/llama] Handler 'reconcile_children' failed" in line
    (doc,) = _log_lines(capsys, True, emit)
    record = json.loads(doc)
    assert record["object"]["namespace"] == "team-a" and record["object"]["name"] == "llama"


async def test_failed_ticks_and_events_name_the_object_in_json_logs(
    posted: list[tuple[str, str, str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The warning and error lines carried no namespace / inferencedeployment fields, so a log
    # query for one object found its scaling lines but not its failures.
    kube, b = await created(SPEC)
    ctx = Context(Options(), kube, source_factory=lambda kind, c: FakeSource(0.6, arrivals=3.0))  # type: ignore[arg-type,return-value]
    ctx.clock = lambda: NOW
    failures = iter([KubeError(503, "ServiceUnavailable", "etcd leader changed"), RuntimeError()])

    async def failing(*args: object, **kwargs: object) -> None:
        raise next(failures)

    monkeypatch.setattr(handlers, "tick", failing)
    ns, name = b["metadata"]["namespace"], b["metadata"]["name"]

    async def ticks() -> list[str]:
        root = logging.getLogger()
        saved = root.handlers[:], root.level, [logging.getLogger(n).level for n in QUIETED]
        try:
            configure_logging(verbose=False, json_format=True)
            for _ in range(2):
                await _tick(ctx, b, parse(b["spec"]), None)
            _post(b, owner_of(b), Outcome(events=[Event("Warning", "Infeasible", "too big")]))
        finally:
            root.handlers[:], root.level = saved[0], saved[1]
            for name, level in zip(QUIETED, saved[2], strict=True):
                logging.getLogger(name).setLevel(level)
        return capsys.readouterr().err.splitlines()

    docs = [json.loads(line) for line in await ticks()]
    assert len(docs) == 3, docs
    for doc in docs:
        assert (doc["namespace"], doc["inferencedeployment"]) == (ns, name), doc
        assert f"{ns}/{name}" in doc["message"], doc


def test_a_quantity_the_server_stored_canonically_is_no_drift() -> None:
    # engine.memory 32768Mi is stored as 32Gi: read as drift, every scale of the Deployment
    # (a generation bump) re-applied the children and logged it.
    from headroom.operator.handlers import _contains, _drifted
    from headroom.operator.reconcile.children import render

    body = {"metadata": {"name": "chat", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {**SPEC, "engine": {"memory": "32768Mi"}}}  # fmt: skip
    parsed = parse(body["spec"])
    assert parsed.spec is not None and parsed.sizing is not None
    (dep,) = [o for o in render(owner_of(body), parsed.spec, parsed.sizing, None)
              if o["kind"] == "Deployment"]  # fmt: skip
    live = json.loads(json.dumps(dep).replace('"32768Mi"', '"32Gi"'))
    assert live != dep and not _drifted(body, live)
    drifted = json.loads(json.dumps(dep).replace('"32768Mi"', '"16Gi"'))
    assert _drifted(body, drifted)
    assert _contains({"cpu": "500m"}, {"cpu": "0.5"}) and not _contains("nginx:1", "nginx:2")


def test_a_spec_that_renders_no_deployment_sees_no_drift() -> None:
    """Infeasible or malformed: the last feasible Deployment keeps running as it is, and a
    change to it is no reason to reconcile (which would apply nothing)."""
    from test_operator_reconcile import INFEASIBLE, body

    from headroom.operator.handlers import _drifted

    someone_edited = {"spec": {"replicas": 3, "template": {"spec": {"containers": []}}}}
    assert not _drifted(body(INFEASIBLE), someone_edited)
    assert not _drifted(body({"model": {"preset": 7}}), someone_edited)
    assert _drifted(body(SPEC), someone_edited)


MIRROR_IMAGE = "registry.example.com:5000/ml/headroom:7.1"
MIRROR_ENGINE = "registry.example.com:5000/ml/headroom-engine:7.1"


def _images(dep: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["image"] for c in dep["spec"]["template"]["spec"]["containers"]}


@pytest.mark.parametrize(("runtime", "engine", "sidecar"), [
    ("headroom", MIRROR_ENGINE, MIRROR_ENGINE),
    ("vllm", "vllm/vllm-openai:v0.11.0", MIRROR_IMAGE),
])  # fmt: skip
async def test_the_operators_headroom_image_is_applied_and_is_no_drift(
    posted: list[tuple[str, str, str]], runtime: str, engine: str, sidecar: str
) -> None:
    # --headroom-image: what the reconcile applies is what the drift check wants. Were they
    # to differ, every event of the Deployment would read as drift and re-apply it, forever.
    from headroom.operator.handlers import _drifted, _reconcile, owned_deployment

    spec = {**SPEC, "engine": {"runtime": runtime},
            "model": {"preset": "llama-3.1-8b", "path": "/models/l8b"}}  # fmt: skip
    kube, b = await created(spec)
    ctx = Context(Options(headroom_image=MIRROR_IMAGE), kube)
    await _reconcile(ctx, b)
    (dep,) = [o for k, _, o in kube.applies if k == "Deployment"]
    assert _images(dep) == {"engine": engine, "sidecar": sidecar}
    live = kube.get("apps/v1", "Deployment", "ns", "chat")
    assert not _drifted(b, live, ctx.options.images)
    # The stock images' drift check would undo the operator's own apply.
    assert _drifted(b, live)

    # The watch of the Deployment, through the handler: first sight, then a newer generation
    # (a scale) whose spec still holds what was applied: nothing re-applied.
    kube.objects[("InferenceDeployment", "ns", "chat")] = b
    kube.applies.clear()
    watch: Any = owned_deployment  # kopf's decorator types it as its registry's callback
    for generation in (1, 2):
        live["metadata"]["generation"] = generation
        live["metadata"]["ownerReferences"] = [{"kind": "InferenceDeployment", "name": "chat"}]
        event = {"type": "MODIFIED", "object": copy.deepcopy(live)}
        await watch(event=event, memo=kopf.Memo(ctx=ctx))
    assert kube.applies == [], "a reconciled Deployment with the operator's images read as drift"
    # Someone sets the ghcr.io image back: that is drift, undone with the operator's images.
    for c in live["spec"]["template"]["spec"]["containers"]:
        c["image"] = c["image"].replace("registry.example.com:5000/ml", "ghcr.io/headroom-dev")
    live["metadata"]["generation"] = 3
    await watch(event={"type": "MODIFIED", "object": live}, memo=kopf.Memo(ctx=ctx))
    (dep,) = [o for k, _, o in kube.applies if k == "Deployment"]
    assert _images(dep) == {"engine": engine, "sidecar": sidecar}


_IDEP = ("InferenceDeployment", "ns", "chat")


class _StatusKube(FakeKube):
    """FakeKube whose status applies land on the stored InferenceDeployment (conditions merged
    by type) and honour a resourceVersion precondition, as the API server's do."""

    def apply_status(
        self,
        owner: Any,
        status: dict[str, Any],
        *,
        field_manager: str,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        obj = self.objects[_IDEP]
        if resource_version not in (None, obj["metadata"]["resourceVersion"]):
            raise KubeError(409, "Conflict", "the object has been modified")
        super().apply_status(owner, status, field_manager=field_manager)  # records it
        st = obj.setdefault("status", {})
        for k, v in status.items():
            if k == "conditions":
                by_type = {c["type"]: c for c in st.get("conditions", [])}
                st["conditions"] = list({**by_type, **{c["type"]: c for c in v}}.values())
            else:
                st[k] = v
        obj["metadata"]["resourceVersion"] = self._bump()
        return obj


def _deployment_event(kube: FakeKube) -> dict[str, Any]:
    dep = kube.get("apps/v1", "Deployment", "ns", "chat")
    assert dep is not None
    owner = {"kind": "InferenceDeployment", "name": "chat"}
    dep["metadata"].update(name="chat", namespace="ns", generation=1, ownerReferences=[owner])
    return {"type": "MODIFIED", "object": dep}


async def test_a_pod_lost_while_a_tick_scrapes_does_not_leave_ready_true(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watch writes Ready=False when a pod goes unready; a tick that read the Deployment
    before its scrape (seconds earlier) wrote Ready=True back over it, and the watch, having
    written those figures already, skipped every later event: Ready stayed True for up to an
    intervalSeconds. The tick now reads the Deployment again after its write."""
    from headroom.operator.handlers import _tick, owned_deployment

    monkeypatch.setattr(kopf, "event", lambda *a, **k: None)
    base, body = await created(SPEC, replicas=2)
    kube = _StatusKube()
    kube.__dict__.update(base.__dict__)
    body["metadata"]["resourceVersion"] = kube._bump()
    kube.objects[_IDEP] = body
    memo = kopf.Memo()
    watch: Any = owned_deployment
    seen: list[str] = []

    class Racing(FakeSource):
        async def sample(self, target: Any, infos: Any) -> Any:
            kube.ready = 1  # a pod fails its readiness probe mid-scrape
            await watch(event=_deployment_event(kube), memo=memo)
            seen.append(
                get_condition(kube.objects[_IDEP]["status"]["conditions"], "Ready")["status"]
            )
            return await super().sample(target, infos)

    ctx = Context(Options(), kube, source_factory=lambda kind, c: Racing(0.5))
    memo["ctx"] = ctx
    await watch(event=_deployment_event(kube), memo=memo)  # first sight: the reconcile's
    now = copy.deepcopy(kube.objects[_IDEP])
    await _tick(ctx, now, parse(now["spec"]), None)
    await watch(event=_deployment_event(kube), memo=memo)  # a later event, the same figures
    assert seen == ["False"], "the watch wrote the lost pod at once"
    ready = get_condition(kube.objects[_IDEP]["status"]["conditions"], "Ready")
    assert (ready["status"], ready["message"]) == ("False", "1/2 replicas ready")
    assert [m for m, _ in kube.statuses] == [
        "headroom-readiness",
        SCALING_MANAGER,
        "headroom-readiness",
    ]


class _HeldKube(FakeKube):
    """Deployment applies of one model path wait until released: a reconcile caught mid-apply."""

    def __init__(self) -> None:
        super().__init__()
        self.held_path = ""  # set once the object exists
        self.holding = threading.Event()
        self.release = threading.Event()

    def apply(self, obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
        if obj["kind"] == "Deployment" and self.held_path and self.held_path in json.dumps(obj):
            self.holding.set()
            assert self.release.wait(30), "the held apply was never released"
        return super().apply(obj, **kw)


def _deployed_path(kube: FakeKube) -> str:
    dep = kube.objects[("Deployment", "ns", "chat")]
    return "/models/new" if "/models/new" in json.dumps(dep["spec"]) else "/models/old"


def _spec_at(path: str) -> dict[str, Any]:
    return {**SPEC, "model": {"preset": "llama-3.1-8b", "path": path}}


@pytest.mark.parametrize("cancelled", [False, True])
async def test_a_resync_of_the_previous_spec_never_lands_after_the_new_one(
    posted: list[tuple[str, str, str]], cancelled: bool
) -> None:
    """The resync reconciles the spec as it read it; a GitOps sync of a new generation can land
    while its applies are in flight. The old spec's Deployment must not be applied over the
    new one (a rollout back, then the drift check's rollout forward), nor its status last.
    Cancelled (the operator exiting, a peering pause), the resync still waits for the worker
    thread that applies, which no cancel stops, before it lets go of the object."""
    kube = _HeldKube()
    old, new = await _generations_1_and_2(kube)
    kube.held_path = "/models/old"
    ctx = Context(Options(), kube)
    resync = asyncio.create_task(handlers._reconcile(ctx, old))
    assert await asyncio.to_thread(kube.holding.wait, 30)
    if cancelled:
        resync.cancel()
    update = asyncio.create_task(handlers._reconcile(ctx, new))
    await asyncio.sleep(0.2)
    assert not resync.done() and not update.done()  # both wait on the apply in flight
    assert _deployed_path(kube) == "/models/old" and kube.applies == []
    kube.release.set()
    outcome = await asyncio.gather(resync, update, return_exceptions=True)
    assert isinstance(outcome[0], asyncio.CancelledError) == cancelled and outcome[1] is None
    assert _deployed_path(kube) == "/models/new"
    assert kube.statuses[-1][1]["observedGeneration"] == 2


async def test_a_reconcile_cancelled_twice_still_says_how_it_ended(
    posted: list[tuple[str, str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    """A second cancel stops the wait for the apply, not the apply: when that fails later, the
    operator's log says so (asyncio would otherwise report an exception never retrieved)."""

    class Failing(_HeldKube):
        def apply(self, obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
            applied = super().apply(obj, **kw)
            if self.release.is_set():
                raise RuntimeError("the API server went away")
            return applied

    kube = Failing()
    old, _ = await _generations_1_and_2(kube)
    kube.held_path = "/models/old"
    resync = asyncio.create_task(handlers._reconcile(Context(Options(), kube), old))
    assert await asyncio.to_thread(kube.holding.wait, 30)
    resync.cancel()
    await asyncio.sleep(0.05)  # the first cancel reached the wait for the apply
    resync.cancel()
    with pytest.raises(asyncio.CancelledError):
        await resync
    with caplog.at_level(logging.DEBUG, logger="headroom.operator"):
        kube.release.set()
        for _ in range(500):
            if any("a cancelled reconcile ended with" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.02)
    ended = [r for r in caplog.records if "a cancelled reconcile ended with" in r.getMessage()]
    assert ended and ended[0].levelno == logging.WARNING


class _HeldStatusKube(FakeKube):
    """Status writes of one generation wait until released: a reconcile caught writing."""

    def __init__(self) -> None:
        super().__init__()
        self.held_generation = 0  # set once the object exists
        self.holding = threading.Event()
        self.release = threading.Event()

    def apply_status(self, owner: Any, status: dict[str, Any], **kw: Any) -> Any:
        if self.held_generation and status.get("observedGeneration") == self.held_generation:
            self.holding.set()
            assert self.release.wait(30), "the held status write was never released"
        return super().apply_status(owner, status, **kw)


async def test_a_resync_cancelled_mid_status_write_lets_the_new_status_land_last(
    posted: list[tuple[str, str, str]],
) -> None:
    """The status write after the apply runs in a worker thread too: cancelled there, the
    reconcile still holds the lock until it lands, so the new generation's status is last."""
    kube = _HeldStatusKube()
    old, new = await _generations_1_and_2(kube)
    kube.held_generation = 1
    ctx = Context(Options(), kube)
    resync = asyncio.create_task(handlers._reconcile(ctx, old))
    assert await asyncio.to_thread(kube.holding.wait, 30)
    resync.cancel()
    update = asyncio.create_task(handlers._reconcile(ctx, new))
    await asyncio.sleep(0.2)
    assert not update.done()
    kube.release.set()
    with pytest.raises(asyncio.CancelledError):
        await resync
    await update
    assert _deployed_path(kube) == "/models/new"
    assert [s["observedGeneration"] for _, s in kube.statuses][-2:] == [1, 2]


async def test_a_resync_read_before_the_new_spec_was_applied_applies_nothing(
    posted: list[tuple[str, str, str]],
) -> None:
    kube = _HeldKube()
    old, new = await _generations_1_and_2(kube)
    ctx = Context(Options(), kube)
    await handlers._reconcile(ctx, new)
    kube.applies.clear()
    statuses = len(kube.statuses)
    await handlers._reconcile(ctx, old)  # a resync (or drift repair) that read generation 1
    assert kube.applies == [] and len(kube.statuses) == statuses
    assert _deployed_path(kube) == "/models/new"
    # The same generation again (the next resync) and a re-created object do apply.
    await handlers._reconcile(ctx, new)
    assert kube.kinds_applied().count("Deployment") == 1
    # Deleted and created again under the same name: the garbage collector took the children.
    kube.objects = {k: v for k, v in kube.objects.items() if k[0] == "InferenceDeployment"}
    again = copy.deepcopy(old)
    again["metadata"]["uid"] = "u-2"
    await handlers._reconcile(ctx, again)
    assert _deployed_path(kube) == "/models/old"
    forget: Any = handlers.forget  # kopf's decorator types it as its registry's callback
    forget(name="chat", namespace="ns", memo=kopf.Memo(ctx=ctx))
    assert ctx.reconciled == {} and ctx.reconciling == {}


async def _generations_1_and_2(kube: FakeKube) -> tuple[dict[str, Any], dict[str, Any]]:
    """The object created (and reconciled) at /models/old, and its generation 2 at /models/new
    as a GitOps sync would bring it."""
    old = await _created_at(kube, "/models/old")
    new = copy.deepcopy(old)
    new["metadata"]["generation"] = 2
    new["spec"] = _spec_at("/models/new")
    return old, new


async def _created_at(kube: FakeKube, path: str) -> dict[str, Any]:
    from test_operator_reconcile import body

    b = body(_spec_at(path))
    kube.objects[("InferenceDeployment", "ns", "chat")] = b
    await handlers._reconcile(Context(Options(), kube), b)
    kube.applies.clear()
    return b


# ----------------------------------------------------------------------------- tick status writes


class ConflictKube(FakeKube):
    """Status applies that name a resourceVersion meet a newer object `conflicts` times (409);
    `error` instead refuses every apply with that KubeError. Records each apply's precondition."""

    def __init__(self, conflicts: int = 0, error: KubeError | None = None) -> None:
        super().__init__()
        self.conflicts, self.error = conflicts, error
        self.guards: list[str | None] = []

    def apply_status(
        self,
        owner: Any,
        status: dict[str, Any],
        *,
        field_manager: str,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        self.guards.append(resource_version)
        if self.error is not None:
            raise self.error
        if resource_version is not None and self.conflicts:
            self.conflicts -= 1
            raise KubeError(409, "Conflict", "the object has been modified")
        return super().apply_status(owner, status, field_manager=field_manager)


def _tick_write(version: str) -> tuple[dict[str, Any], Outcome]:
    from test_operator_reconcile import body

    b = body(SPEC)
    b["metadata"]["resourceVersion"] = version
    ready = {"type": "Ready", "status": "True", "reason": "Available", "observedGeneration": 1}
    status = {"desiredReplicas": 5, "conditions": [ready]}
    return b, Outcome(status=status, events=[Event("Normal", "ScaledOut", "4 -> 5: demand")])


async def test_a_tick_status_is_applied_on_its_version_then_rebased_then_forced(
    posted: list[tuple[str, str, str]],
) -> None:
    """Two conflicts: the tick's version, then the re-read one, then no precondition; the
    re-read object's newer generation keeps its own Ready, and the Event goes out once."""
    from test_operator_reconcile import body

    kube = ConflictKube(conflicts=2)
    held = {"type": "Ready", "status": "False", "reason": "ApplyFailed", "observedGeneration": 2}
    fresh = body(SPEC, status={"conditions": [held]}, gen=2)
    fresh["metadata"]["resourceVersion"] = "9"
    kube.objects[("InferenceDeployment", "ns", "chat")] = fresh
    b, outcome = _tick_write("7")
    await handlers._write_tick(Context(Options(), kube), b, outcome)
    assert kube.guards == ["7", "9", None]
    ((manager, status),) = kube.statuses
    assert manager == SCALING_MANAGER and status["desiredReplicas"] == 5
    assert status["conditions"] == [held]
    assert posted == [("Normal", "ScaledOut", "4 -> 5: demand")]


async def test_a_tick_status_refused_for_another_reason_is_not_retried_as_a_conflict(
    posted: list[tuple[str, str, str]],
) -> None:
    """Only a 409 is read again and retried: a denial is raised after one apply, its Events
    still posted."""
    kube = ConflictKube(error=KubeError(403, "Forbidden", "cannot patch status"))
    b, outcome = _tick_write("7")
    with pytest.raises(KubeError, match="Forbidden"):
        await handlers._write_tick(Context(Options(), kube), b, outcome)
    assert kube.guards == ["7"]
    assert [r for _, r, _ in posted] == ["ScaledOut"]


# ----------------------------------------------------------------------------- context


async def test_the_metrics_source_is_the_one_the_spec_names_on_the_operators_session() -> None:
    """scaling.metricsSource prometheus asks Prometheus (with the operator's kept scrapes);
    anything else scrapes the sidecars at --sidecar-port."""
    ctx = Context(Options(prometheus_url="http://prom:9090", sidecar_port=9999), kube=None)  # type: ignore[arg-type]
    ctx.http = client_session()
    try:
        prom, sidecar = ctx.source("prometheus"), ctx.source("sidecar")
    finally:
        await ctx.http.close()
    assert isinstance(prom, PrometheusSource) and prom.session is ctx.http
    assert prom.default_url == "http://prom:9090" and prom._seen is ctx.scrapes
    assert isinstance(sidecar, SidecarSource) and sidecar.session is ctx.http
    assert sidecar.port == 9999


def test_forgetting_one_objects_scrapes_keeps_the_others() -> None:
    """Scrapes are keyed (Prometheus URL, namespace, name): one deleted object's go, under
    every Prometheus, and no other's."""
    ctx = Context(Options(), kube=None)  # type: ignore[arg-type]
    keys = [("http://a", "ns", "chat"), ("http://b", "ns", "chat"), ("http://a", "ns", "other"),
            ("http://a", "other", "chat")]  # fmt: skip
    ctx.scrapes.update({k: {} for k in keys})
    ctx.forget_scrapes("ns", "chat")
    assert sorted(ctx.scrapes) == sorted(keys[2:])


def test_the_children_are_re_applied_every_five_minutes_by_default() -> None:
    """--resync-seconds defaults to the 300 the README gives."""
    assert Options().resync_seconds == 300.0


def test_the_sidecar_port_option_is_a_port() -> None:
    """--sidecar-port 0 (or above 65535) is refused at start, not at every scrape."""
    assert Options(sidecar_port=1).sidecar_port == 1
    for bad in (0, 65536):
        with pytest.raises(ValueError, match="sidecar_port"):
            Options(sidecar_port=bad)


# ----------------------------------------------------------------------------- reconcile retries


async def test_a_name_conflict_is_written_then_retried_with_the_ready_message(
    posted: list[tuple[str, str, str]],
) -> None:
    """Someone else's Deployment under the name: Ready says so in status, and kopf retries
    after the reconcile's delay with the same words in its log."""
    from test_operator_reconcile import _someone_elses, body

    from headroom.operator.reconcile.loop import CONFLICT_RETRY_SECONDS

    kube = FakeKube()
    kube.objects[("Deployment", "ns", "chat")] = _someone_elses("Deployment")
    with pytest.raises(kopf.TemporaryError) as raised:
        await handlers._reconcile(Context(Options(), kube), body(SPEC))
    ((_, status),) = kube.statuses
    ready = get_condition(status["conditions"], "Ready")
    assert ready is not None and ready["reason"] == "NameConflict"
    assert str(raised.value) == ready["message"] and raised.value.delay == CONFLICT_RETRY_SECONDS


async def test_an_api_error_in_a_reconcile_is_retried_by_kopf_after_five_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transient API failure (past the client's own retries) is kopf's to retry, in 5 s."""
    from test_operator_reconcile import body

    def unavailable(*args: object) -> None:
        raise KubeError(503, "ServiceUnavailable", "etcd leader changed")

    monkeypatch.setattr(handlers, "reconcile", unavailable)
    ctx = Context(Options(), FakeKube())  # type: ignore[arg-type]
    with pytest.raises(kopf.TemporaryError, match=r"Kubernetes API: .*etcd") as raised:
        await handlers._reconcile(ctx, body(SPEC))
    assert raised.value.delay == 5
    errors = {"result": "error"}
    assert ctx.metrics.registry.get_sample_value("headroom_reconciles_total", errors) == 1


# ----------------------------------------------------------------------------- kopf's connection


def test_kopf_logs_in_with_the_operators_own_credentials() -> None:
    """A bearer token splits into scheme and token, a bare one is a token, basic auth passes
    its user, and verify_ssl off is kopf's insecure."""
    from types import SimpleNamespace

    from kubernetes.client import Configuration

    from headroom.operator.handlers import connection_info

    cfg = Configuration(host="https://k:6443", api_key={"BearerToken": "abc"},
                        api_key_prefix={"BearerToken": "Bearer"})  # fmt: skip
    cfg.verify_ssl = False
    info = connection_info(SimpleNamespace(configuration=cfg))  # type: ignore[arg-type]
    assert (info.server, info.scheme, info.token, info.insecure) == (
        "https://k:6443", "Bearer", "abc", True)  # fmt: skip
    assert info.username is None and info.password is None
    bare = Configuration(host="https://k:6443", api_key={"BearerToken": "abc"})
    info = connection_info(SimpleNamespace(configuration=bare))  # type: ignore[arg-type]
    assert (info.scheme, info.token, info.insecure) == (None, "abc", False)
    basic = Configuration(host="https://k:6443", username="admin", password="pw")
    info = connection_info(SimpleNamespace(configuration=basic))  # type: ignore[arg-type]
    assert (info.username, info.password, info.token) == ("admin", "pw", None)


@pytest.mark.parametrize(("host", "url"), [("127.0.0.1", "http://127.0.0.1:8081/healthz"),
                                           ("::1", "http://[::1]:8081/healthz")])  # fmt: skip
async def test_the_liveness_endpoint_brackets_an_ipv6_host(
    monkeypatch: pytest.MonkeyPatch, host: str, url: str
) -> None:
    """kopf's liveness endpoint is a URL: an IPv6 bind address goes in brackets."""
    seen: dict[str, Any] = {}

    async def operator(**kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr("kopf.operator", operator)
    await handlers.operate(Options(liveness_port=8081, liveness_host=host), kube=FakeKube())  # type: ignore[arg-type]
    assert seen["liveness_endpoint"] == url
