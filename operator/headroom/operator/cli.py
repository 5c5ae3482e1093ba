"""`headroom operator` (run the controller) and `headroom crd` (print the CRD YAML).

kopf and the Kubernetes client load inside `run_operator`, so building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from pydantic import ValidationError

from headroom.contract.ports import SIDECAR_PORT
from headroom.operator.crd.models import HEADROOM_IMAGE


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `headroom operator` and `headroom crd`."""
    op = subparsers.add_parser(
        "operator",
        help="run the InferenceDeployment operator",
        description="Reconcile InferenceDeployments (headroom.dev/v1alpha1): size pods from KV "
        "arithmetic, own their Deployment, and scale it before the KV cache saturates.",
    )
    scope = op.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="watch this namespace (repeatable; globs like 'team-*' work, and kopf's patterns: "
        "each is watched on its own, so 'team-*,!team-x' excludes team-x in one)",
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch every namespace (default)"
    )
    op.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then ~/.kube)")
    op.add_argument("--metrics-port", type=int, default=8080, help="/metrics port (0: off)")
    op.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address /metrics listens on (in a pod: 0.0.0.0, or the pod IP)",
    )
    op.add_argument("--liveness-port", type=int, default=0, help="/healthz port (0: off)")
    op.add_argument(
        "--liveness-host",
        default="127.0.0.1",
        help="address /healthz listens on (in a pod: 0.0.0.0, or the pod IP, for the kubelet)",
    )
    op.add_argument(
        "--prometheus-url", help="Prometheus base URL for scaling.metricsSource: prometheus"
    )
    op.add_argument(
        "--allow-prometheus-url",
        action="append",
        dest="allowed_prometheus_urls",
        metavar="GLOB",
        help="a spec's scaling.prometheusURL this operator may query (repeatable; a glob such as "
        "'http://*.monitoring.svc:9090'). By default only --prometheus-url: whoever may create "
        "an InferenceDeployment could otherwise have the operator send requests anywhere",
    )
    op.add_argument(
        "--prometheus-rate-window",
        default="1m",
        metavar="DURATION",
        help="range of the rate() queries to Prometheus (a PromQL duration such as 2m; at least "
        "4x Prometheus' scrape interval, or every rate series comes back empty)",
    )
    op.add_argument(
        "--sidecar-port", type=int, default=SIDECAR_PORT, help="sidecar /saturation port"
    )
    op.add_argument(
        "--resync-seconds",
        type=float,
        default=300.0,
        help="re-apply every InferenceDeployment's children this often (a deleted Service or "
        "PodDisruptionBudget comes back; applying what is there writes nothing)",
    )
    op.add_argument(
        "--headroom-image",
        default=HEADROOM_IMAGE,
        metavar="IMAGE",
        help="headroom's small image, REPO:TAG, that the sidecars of vLLM and SGLang pods run; "
        "runtime headroom's pods run REPO-engine:TAG (the two images `make image` builds; "
        "default %(default)s). An InferenceDeployment's engine.image and engine.sidecarImage "
        "win. No digest: none can be derived for the engine's image; pin by digest with "
        "engine.image per InferenceDeployment",
    )
    op.add_argument("--peering", help="kopf peering name to run several replicas (HA)")
    op.add_argument(
        "--priority",
        type=int,
        help="kopf peering priority; the highest live one is active, the others stand by "
        "(default with --peering: drawn at random at startup, so replicas never tie)",
    )
    op.add_argument("--log-format", choices=["json", "text"], default="json")
    op.add_argument("--verbose", "-v", action="store_true", help="debug logs")
    op.set_defaults(func=run_operator)

    crd = subparsers.add_parser(
        "crd",
        help="print the InferenceDeployment CRD",
        description="Print the CustomResourceDefinition generated from the pydantic models "
        "(what crds/inferencedeployment.yaml holds).",
    )
    crd.set_defaults(func=run_crd)


def run_crd(args: argparse.Namespace) -> int:
    """Print the CRD YAML to stdout."""
    from headroom.operator.crd.schema import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def configure_logging(*, verbose: bool, json_format: bool) -> None:
    """kopf's log handler in text or JSON; quiet (warnings, and headroom's own scaling lines)
    unless verbose."""
    import kopf

    kopf.configure(
        verbose=verbose,
        log_format=kopf.LogFormat.JSON if json_format else kopf.LogFormat.FULL,
        # kopf's own default: "[namespace/name] " before its object lines in text (its JSON
        # lines carry the object as fields); False printed "Handler ... failed" about nothing.
        log_prefix=None,
    )
    # kopf narrates every handler run at INFO, and its /healthz server logs every kubelet probe
    # (aiohttp's access log: a line each 10 s, forever); keep the operator quiet by default.
    for name in ("kopf", "aiohttp.access"):
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)


def run_operator(args: argparse.Namespace) -> int:
    """Run the operator in the foreground until SIGINT/SIGTERM."""
    import yaml
    from kubernetes.config import ConfigException

    from headroom.operator.handlers import Options, operate
    from headroom.operator.kube import Kube
    from headroom.operator.scaling.exporter import OperatorMetrics

    try:
        options = Options(
            namespaces=args.namespaces or [],
            kubeconfig=args.kubeconfig,
            prometheus_url=args.prometheus_url,
            allowed_prometheus_urls=args.allowed_prometheus_urls or [],
            prometheus_rate_window=args.prometheus_rate_window,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            liveness_port=args.liveness_port,
            liveness_host=args.liveness_host,
            sidecar_port=args.sidecar_port,
            peering=args.peering,
            priority=args.priority,
            resync_seconds=args.resync_seconds,
            headroom_image=args.headroom_image,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0])
        flag = "namespace" if field == "namespaces" else field.replace("_", "-")
        msg = str(first["msg"]).removeprefix("Value error, ")
        print(f"headroom operator: --{flag}: {msg}", file=sys.stderr)
        return 2
    try:
        kube = Kube.connect(options.kubeconfig)
    except (ConfigException, OSError, TypeError, ValueError, yaml.YAMLError) as exc:
        # A missing, unreadable or malformed kubeconfig (not YAML at all: the client lets
        # PyYAML's error through): the library's own text, one line.
        where = f"--kubeconfig {options.kubeconfig}" if options.kubeconfig else "kubeconfig"
        text = " ".join(str(exc).split())  # PyYAML's message spans lines, with a caret
        print(f"headroom operator: {where}: {type(exc).__name__}: {text}", file=sys.stderr)
        return 2
    configure_logging(verbose=args.verbose, json_format=args.log_format == "json")
    metrics = OperatorMetrics()
    try:
        if options.metrics_port:
            metrics.serve(options.metrics_port, addr=str(options.metrics_host))
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(operate(options, kube=kube, metrics=metrics))
    except OSError as exc:
        if exc.errno is None:
            # Not the system refusing a port: on Python 3.11 a TimeoutError out of kopf's
            # shutdown is an OSError too, and it would print as one empty line.
            raise
        print(f"headroom operator: {exc}", file=sys.stderr)  # a port taken, as `serve` says it
        return 1
    return 0
