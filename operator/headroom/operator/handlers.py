"""kopf wiring: a few-line handler per event, each a shell around reconcile() or tick().

Persistence (decided here, documented in the report): kopf keeps its handler progress and its
last-handled configuration in `status.kopf` (a preserve-unknown-fields stanza of the CRD) rather
than in annotations, so the operator writes nothing but `/status` on the resource, plus one
finalizer, `headroom.dev/finalizer`, which kopf needs to stop a resource's timer before the
object goes away. Spec is never written: GitOps tools see no drift.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import kopf
from pydantic import BaseModel, ConfigDict, Field

from headroom.contract.ports import SIDECAR_PORT
from headroom.operator.crd.models import GROUP, PLURAL, VERSION
from headroom.operator.kube import Kube, KubeError
from headroom.operator.reconcile.loop import reconcile
from headroom.operator.reconcile.sizing import parse
from headroom.operator.scaling.exporter import OperatorMetrics
from headroom.operator.scaling.loop import tick
from headroom.operator.scaling.metrics_sources import MetricsSource, PrometheusSource, SidecarSource
from headroom.operator.status import Outcome, set_condition

log = logging.getLogger("headroom.operator")
FINALIZER = f"{GROUP}/finalizer"
SourceFactory = Callable[[str, "Context"], MetricsSource]


class Options(BaseModel):
    """`headroom operator` settings."""

    model_config = ConfigDict(extra="forbid")

    namespaces: list[str] = Field(default_factory=list, description="empty: all namespaces")
    kubeconfig: str | None = None
    prometheus_url: str | None = None
    metrics_port: int = Field(default=8080, ge=0, le=65535, description="0 disables /metrics")
    liveness_port: int = Field(default=0, ge=0, le=65535, description="0 disables /healthz")
    tick_seconds: float = Field(default=5.0, gt=0, le=300, description="timer granularity")
    sidecar_port: int = Field(default=SIDECAR_PORT, ge=1, le=65535)
    peering: str | None = Field(
        default=None, description="kopf peering name for HA; else standalone"
    )
    max_workers: int = Field(default=8, ge=1, le=64)


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
        self.http: aiohttp.ClientSession | None = None

    def source(self, kind: str) -> MetricsSource:
        """The metrics source a spec's `scaling.metricsSource` names."""
        if self.source_factory is not None:
            return self.source_factory(kind, self)
        assert self.http is not None, "the HTTP session opens at operator startup"
        if kind == "prometheus":
            return PrometheusSource(self.http, self.options.prometheus_url)
        return SidecarSource(self.http, port=self.options.sidecar_port)


def _ctx(memo: kopf.Memo) -> Context:
    ctx: Context = memo["ctx"]
    return ctx


def _write(outcome: Outcome, patch: kopf.Patch, body: kopf.Body) -> None:
    for key, value in outcome.status.items():
        patch.status[key] = value
    meta = body.get("metadata", {})
    for ev in outcome.events:
        kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message[:1024])
        # Each Event is also one structured log line (JSON with --log-format json).
        log.log(
            logging.WARNING if ev.type == "Warning" else logging.INFO,
            "%s: %s",
            ev.reason,
            ev.message,
            extra={
                "namespace": meta.get("namespace"),
                "inferencedeployment": meta.get("name"),
                "reason": ev.reason,
            },
        )


def _retry(exc: KubeError) -> kopf.TemporaryError:
    delay = 5 if exc.transient else 60
    return kopf.TemporaryError(f"Kubernetes API: {exc}", delay=delay)


def build_registry(options: Options) -> kopf.OperatorRegistry:
    """A kopf registry with headroom's handlers (one per process, or one per test)."""
    registry = kopf.OperatorRegistry()
    on = {"registry": registry}

    @kopf.on.startup(**on)  # type: ignore[arg-type]
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
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
        if ctx.options.peering:
            settings.peering.name = ctx.options.peering
            settings.peering.standalone = False
        else:
            settings.peering.standalone = True
        ctx.http = aiohttp.ClientSession()

    @kopf.on.cleanup(**on)  # type: ignore[arg-type]
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        ctx = _ctx(memo)
        if ctx.http is not None:
            await ctx.http.close()

    @kopf.on.login(**on)  # type: ignore[arg-type]
    def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
        return connection_info(_ctx(memo).kube)

    @kopf.on.resume(GROUP, VERSION, PLURAL, backoff=5, **on)  # type: ignore[arg-type]
    @kopf.on.create(GROUP, VERSION, PLURAL, backoff=5, **on)  # type: ignore[arg-type]
    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", backoff=5, **on)  # type: ignore[arg-type]
    async def reconcile_handler(
        body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any
    ) -> None:
        ctx = _ctx(memo)
        try:
            outcome = await asyncio.to_thread(reconcile, ctx.kube, dict(body), ctx.clock())
        except KubeError as exc:
            ctx.metrics.reconciles.labels("error").inc()
            kopf.event(body, type="Warning", reason="ApplyFailed", message=str(exc)[:1024])
            # Say so in status too (kopf writes the patch before it retries the handler).
            patch.status["conditions"] = set_condition(
                (body.get("status") or {}).get("conditions"), "Ready", "False", "ApplyFailed",
                f"applying the children failed, retrying: {exc}", generation=body.meta.get(
                    "generation"), now=ctx.clock(),
            )  # fmt: skip
            raise _retry(exc) from None
        ctx.metrics.reconciles.labels("ok").inc()
        _write(outcome, patch, body)

    @kopf.timer(GROUP, VERSION, PLURAL, interval=options.tick_seconds, **on)  # type: ignore[arg-type]
    async def scaling_timer(
        body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any
    ) -> None:
        ctx = _ctx(memo)
        now = ctx.clock()
        parsed = parse(body.get("spec"))
        interval = parsed.spec.scaling.interval_seconds if parsed.spec else 60
        if now - memo.get("last_tick", 0.0) < interval - ctx.options.tick_seconds / 2:
            return
        memo["last_tick"] = now
        if parsed.spec is None:
            return
        source = ctx.source(parsed.spec.scaling.metrics_source)
        try:
            result = await tick(
                ctx.kube, source, dict(body), now, memo.get("scale_in"), memo.get("recent", ())
            )
        except KubeError as exc:
            logger.warning("scaling tick failed: %s", exc)
            raise _retry(exc) from None
        if result.needs_reconcile:
            _write(await asyncio.to_thread(reconcile, ctx.kube, dict(body), now), patch, body)
            return
        # Windows live in memory: after a restart they refill, which only delays a scale-in.
        memo["scale_in"], memo["recent"] = result.scale_in, result.recent
        if result.decision is not None and result.current is not None:
            meta = body["metadata"]
            ctx.metrics.publish(
                meta["namespace"], meta["name"], result.mode, result.decision.replicas,
                result.current,
            )  # fmt: skip
            if result.decision.action != "hold":
                ctx.metrics.decisions.labels(
                    meta["namespace"], meta["name"], result.decision.action,
                    result.decision.reason,
                ).inc()  # fmt: skip
        _write(result.outcome, patch, body)

    @kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, **on)  # type: ignore[arg-type]
    def forget(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
        _ctx(memo).metrics.forget(namespace, name)

    return registry


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
    liveness = f"http://0.0.0.0:{options.liveness_port}/healthz" if options.liveness_port else None
    await kopf.operator(
        registry=build_registry(options),
        memo=kopf.Memo(ctx=ctx),
        clusterwide=not options.namespaces,
        namespaces=options.namespaces,
        standalone=options.peering is None,
        peering_name=options.peering,
        liveness_endpoint=liveness,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
