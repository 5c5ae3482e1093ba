"""The ports the parts listen on: the operator's pod template, the sidecar's flags and the
operator's direct scrape all read them here."""

from __future__ import annotations

ENGINE_PORT = 8000  # the engine's OpenAI-compatible API, /stats, /health (vLLM and SGLang too)
SIDECAR_PORT = 9090  # the sidecar's /metrics and /saturation
OPERATOR_METRICS_PORT = 8080  # the operator's own /metrics
