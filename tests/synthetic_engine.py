"""A scriptable stand-in for an engine's `/stats`, for the sidecar's benchmark and fault tests.

A test double: it lives with the tests (and `bench/sidecar.py` imports it from here), not in
the shipped package.

It produces real `StatsSnapshot` bodies (the engine's own model) from state the caller sets, and
can misbehave on purpose: answer slowly, answer garbage, answer an unknown schema version,
answer HTTP errors, or restart (new `instance_id`, counters back to zero). It is not an engine:
nothing is scheduled; the caller moves the numbers.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web

from headroom.contract.stats import (
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    Histogram,
    KVBlockStats,
    PrefixCacheStats,
    RequestStats,
    StatsSnapshot,
)

Behaviour = Literal["ok", "slow", "garbage", "bad_version", "http_500"]


@dataclass(slots=True)
class SyntheticEngine:
    """Engine state the caller scripts; `snapshot()` renders it as the engine would."""

    capacity: int = 1024
    block_size: int = 16
    bytes_per_token: int = 4096
    model: str = "synthetic"
    used: int = 0
    cached: int = 0
    prefix_enabled: bool = True
    queries_tokens_total: int = 0
    hits_tokens_total: int = 0
    running: int = 0
    waiting: int = 0
    preemptions_total: int = 0
    # the demand counters (cumulative, like the engine's)
    requests_arrived_total: int = 0
    prompt_tokens_arrived_total: int = 0
    kv_block_seconds_total: float = 0.0
    requests_finished_total: int = 0
    ttft_counts: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS_S))
    ttft_sum: float = 0.0
    ttft_count: int = 0
    behaviour: Behaviour = "ok"
    slow_seconds: float = 5.0
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)

    def set_used(self, used: int) -> None:
        """Move used blocks (clipped to the pool), keeping free + used + cached == capacity."""
        self.used = max(0, min(used, self.capacity - self.cached))

    def observe_ttft(self, seconds: float) -> None:
        """Record one time-to-first-token observation in the cumulative buckets."""
        for i, bound in enumerate(TTFT_BUCKETS_S):
            if seconds <= bound:
                self.ttft_counts[i] += 1
        self.ttft_sum += seconds
        self.ttft_count += 1

    def restart(self) -> None:
        """What a real restart looks like from outside: new id, empty pool, counters at zero."""
        self.instance_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.used = self.cached = self.running = self.waiting = 0
        self.queries_tokens_total = self.hits_tokens_total = self.preemptions_total = 0
        self.requests_arrived_total = self.prompt_tokens_arrived_total = 0
        self.requests_finished_total = 0
        self.kv_block_seconds_total = 0.0
        self.ttft_counts = [0] * len(TTFT_BUCKETS_S)
        self.ttft_sum, self.ttft_count = 0.0, 0

    def snapshot(self) -> StatsSnapshot:
        """The current state as a `/stats` body."""
        kv = KVBlockStats(
            block_size=self.block_size,
            capacity=self.capacity,
            free=self.capacity - self.used - self.cached,
            used=self.used,
            cached=self.cached,
            bytes_per_token=self.bytes_per_token,
        )
        return StatsSnapshot(
            model=self.model,
            instance_id=self.instance_id,
            started_at=self.started_at,
            time=time.time(),
            kv=kv,
            prefix_cache=PrefixCacheStats(
                enabled=self.prefix_enabled,
                queries_tokens_total=self.queries_tokens_total,
                hits_tokens_total=self.hits_tokens_total,
            ),
            requests=RequestStats(running=self.running, waiting=self.waiting),
            preemptions_total=self.preemptions_total,
            steps_total=0,
            requests_arrived_total=self.requests_arrived_total,
            prompt_tokens_arrived_total=self.prompt_tokens_arrived_total,
            kv_block_seconds_total=self.kv_block_seconds_total,
            requests_finished_total=self.requests_finished_total,
            time_to_first_token_seconds=Histogram(
                buckets=list(TTFT_BUCKETS_S),
                counts=list(self.ttft_counts),
                sum=self.ttft_sum,
                count=self.ttft_count,
            ),
            time_per_output_token_seconds=Histogram(
                buckets=list(TPOT_BUCKETS_S), counts=[0] * len(TPOT_BUCKETS_S)
            ),
        )

    def body(self) -> bytes:
        """The JSON body `GET /stats` would return now (ignores `behaviour`)."""
        return self.snapshot().model_dump_json().encode()

    async def handle_stats(self, _: web.Request) -> web.Response:
        """aiohttp handler for `GET /stats`, honouring `behaviour`."""
        if self.behaviour == "slow":
            await asyncio.sleep(self.slow_seconds)
        if self.behaviour == "garbage":
            return web.Response(body=b"<html>not json", content_type="text/html")
        if self.behaviour == "http_500":
            return web.Response(status=500, text="engine exploded")
        if self.behaviour == "bad_version":
            doc = self.snapshot().model_dump()
            doc["version"] = 999
            return web.json_response(doc)
        return web.Response(body=self.body(), content_type="application/json")

    def app(self) -> web.Application:
        """An aiohttp app serving this engine's `/stats`."""
        app = web.Application()
        app.router.add_get("/stats", self.handle_stats)
        return app
