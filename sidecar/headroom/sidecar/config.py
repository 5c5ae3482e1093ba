"""The sidecar's configuration, validated once at start (from CLI flags and the pod's env)."""

from __future__ import annotations

from typing import Self
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from headroom.contract.ports import SIDECAR_PORT
from headroom.contract.report import SourceKind

# The variable the operator puts the engine's key in for the sidecar (runtimes.py's
# SIDECAR_API_KEY_ENV; a test keeps them equal).
API_KEY_ENV = "HEADROOM_API_KEY"
DEFAULT_PATHS: dict[str, str] = {"headroom": "/stats", "vllm": "/metrics", "sglang": "/metrics"}


class IdentityLabels(BaseModel):
    """The Prometheus labels every series carries; an empty value is left off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = ""
    namespace: str = ""
    inferencedeployment: str = ""
    pod: str = ""


class SidecarConfig(BaseModel):
    """Everything one sidecar needs; bad values fail here with a message naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_url: str = Field(description="engine base URL; /stats or /metrics is appended")
    source: SourceKind = "headroom"
    page_size: int = Field(
        default=1,
        ge=1,
        description="tokens per KV page, for the sglang source (SGLang's --page-size); the "
        "server's own page size wins when its server-info endpoint answers",
    )
    planned_blocks: int | None = Field(
        default=None,
        ge=1,
        description="the KV pool the operator planned for this pod, in blocks; exported as "
        "headroom_kv_blocks_planned beside the running pool's capacity",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description=f"bearer token for the engine's guarded routes (SGLang's server info under "
        f"--api-key), from ${API_KEY_ENV}",
    )
    host: str = "0.0.0.0"
    port: int = Field(default=SIDECAR_PORT, ge=0, le=65535)
    interval: float = Field(default=1.0, gt=0, le=3600, description="seconds between polls")
    timeout: float = Field(default=0.8, gt=0, description="seconds before a poll is abandoned")
    # Finite and bounded: the history kept is as long as the longer window.
    window: float = Field(
        default=60.0, gt=0, le=86400, allow_inf_nan=False,
        description="hit-ratio / rate window, seconds",
    )  # fmt: skip
    forecast_window: float = Field(
        default=30.0, gt=0, le=86400, allow_inf_nan=False,
        description="slope-fit window, seconds",
    )  # fmt: skip
    min_forecast_points: int = Field(default=3, ge=2)
    shutdown_wait: float = Field(
        default=0.0, ge=0, allow_inf_nan=False,
        description="seconds the sidecar serves on after its stop signal while the engine "
        "still listens (0: it exits at once)",
    )  # fmt: skip
    labels: IdentityLabels = IdentityLabels()

    @model_validator(mode="after")
    def _check(self) -> Self:
        parts = urlsplit(self.engine_url)
        try:
            port = parts.port  # raises on a port past 65535 or not a number
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise ValueError(f"engine_url must be http(s)://HOST:PORT, got {self.engine_url!r}")
        key = self.api_key.get_secret_value() if self.api_key else ""
        if any(ord(c) < 32 or ord(c) == 127 for c in key):
            # An HTTP header cannot carry it (a multi-line Secret, say).
            raise ValueError(f"${API_KEY_ENV} holds a control character")
        if self.window < self.interval:
            raise ValueError(
                f"window ({self.window:g} s) must hold at least one interval ({self.interval:g} s)"
            )
        fit = (self.min_forecast_points - 1) * self.interval
        if self.forecast_window < fit:
            raise ValueError(
                f"forecast_window ({self.forecast_window:g} s) must hold "
                f"{self.min_forecast_points} polls {self.interval:g} s apart (at least {fit:g} s)"
            )
        if self.timeout > self.interval:
            raise ValueError(
                f"timeout ({self.timeout} s) must not exceed interval ({self.interval} s): "
                "polls run one at a time"
            )
        return self

    @property
    def poll_url(self) -> str:
        """The URL polled: engine_url's own path if it has one, else the source's default."""
        parts = urlsplit(self.engine_url)
        if parts.path not in ("", "/"):
            return self.engine_url
        return urlunsplit(parts._replace(path=DEFAULT_PATHS[self.source]))

    def engine_route(self, path: str) -> str:
        """Another route of the engine's server (e.g. SGLang's server info), at engine_url's
        scheme and host."""
        return urlunsplit(urlsplit(self.engine_url)._replace(path=path, query="", fragment=""))

    @property
    def stale_after(self) -> float:
        """Age beyond which the last good poll no longer counts as fresh."""
        return 2 * self.interval + self.timeout
