"""What the HTTP handlers share: the server's settings, and its runtime state typed against the
engine it serves (set once the model is loaded, see runner.attach_engine)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from headroom.engine.health import DEFAULT_STEP_TIMEOUT_S
from headroom.engine.server.chat_template import ChatTemplate
from headroom.engine.server.protocol import now

if TYPE_CHECKING:  # the CLI reads the settings without importing torch
    from headroom.engine.async_engine import AsyncEngine
    from headroom.engine.model.tokenizer import Tokenizer

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_BODY_TIMEOUT_S = 30.0


class SamplingDefaults(BaseModel):
    """What a request that leaves `temperature`, `top_p` or `top_k` out (or sends null) samples
    with: the model's generation_config.json values (`--generation-config auto`, as vLLM's);
    None, the engine's neutral default (1.0, 1.0, off). A request's own value always wins."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The engine's `SamplingParams` bounds: the loader passes on only values within them.
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)

    def given(self) -> dict[str, float | int]:
        """The fields the model sets, by name."""
        return self.model_dump(exclude_none=True)


class ServerSettings(BaseModel):
    """The HTTP side of `headroom serve` (the engine has its own `EngineConfig`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str = Field(min_length=1)
    api_key: str | None = None
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1024)
    body_timeout_s: float = Field(default=DEFAULT_BODY_TIMEOUT_S, gt=0)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # Past this one model step counts as hung (see headroom.engine.health): probes fail.
    step_timeout_s: float = Field(default=DEFAULT_STEP_TIMEOUT_S, gt=0, allow_inf_nan=False)
    sampling_defaults: SamplingDefaults = SamplingDefaults()


@dataclass
class ServerState:
    """Mutable runtime state shared by handlers: set `engine` once the model is loaded."""

    settings: ServerSettings
    max_model_len: int = 0
    engine: AsyncEngine | None = None
    tokenizer: Tokenizer | None = None
    chat_template: ChatTemplate | None = None
    draining: bool = False
    load_error: str | None = None
    created: int = field(default_factory=now)
    active: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def unhealthy(self) -> str | None:
        """Why the loaded engine can no longer serve (its thread died, too many failed steps,
        or one step stuck past the step timeout, see headroom.engine.health); None while it
        can, or while it is loading."""
        if self.engine is None:
            return None
        if not self.engine.running:
            return "engine loop stopped"
        if not self.engine.health.healthy:
            return f"engine unhealthy: {self.engine.health.reason}"
        return None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.unhealthy is None and not self.draining

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no `/v1/*` request is in flight; False on timeout."""
        if self.active == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


STATE_KEY = web.AppKey("headroom_state", ServerState)


def state_of(request: web.Request) -> ServerState:
    """The state of the application serving `request`."""
    return request.app[STATE_KEY]
