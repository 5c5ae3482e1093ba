"""The ports the parts listen on: the operator's pod template, the sidecar's flags and the
operator's direct scrape all read them here."""

from __future__ import annotations

ENGINE_PORT = 8000  # the engine's OpenAI-compatible API, /stats, /health (vLLM and SGLang too)
# headroom's engine only (`--stats-port`): /health, /ready and /stats on a listener of their own,
# with a connection cap of its own. On ENGINE_PORT they wait behind API connections once those
# reach --max-connections, and then a pod merely busy fails its liveness probe (a restart that
# loses its in-flight work) and its sidecar reports the engine down when scaling needs it most.
ENGINE_STATS_PORT = 8001
SIDECAR_PORT = 9090  # the sidecar's /metrics and /saturation
OPERATOR_METRICS_PORT = 8080  # the operator's own /metrics
