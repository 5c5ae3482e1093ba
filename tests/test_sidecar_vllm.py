"""vLLM mode: a stock vLLM server's `/metrics` read with prometheus-client's parser.

The exposition under test is what vLLM itself produces: `VllmExporter` declares the metrics the
way vLLM v1 does (vllm/v1/metrics/loggers.py: names, help text, `model_name`/`engine` labels,
histogram buckets, `vllm:cache_config_info` as a gauge at 1) on a prometheus-client registry,
and the text is prometheus-client's own rendering, `_created` samples and all. The checked-in
`prometheus/vllm_metrics_dp2.txt` is one such rendering for a data-parallel (2-engine) server
(`render_dp2_fixture`; run this file as a script to regenerate it).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.server import build_app
from headroom.sidecar.sources import GarbageError, parse_vllm_metrics

FIXTURES = Path(__file__).parent / "prometheus"
# vLLM v1's own bucket choices for these two histograms.
# fmt: off
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
# fmt: on


class VllmExporter:
    """vLLM v1's Prometheus metrics, declared as vLLM declares them, on a private registry."""

    def __init__(self, model: str, engines: int = 1, num_gpu_blocks: int = 4096) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        self.engines = [str(i) for i in range(engines)]
        labels = ["model_name", "engine"]
        r = self.registry
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "gpu_memory_utilization",
                "num_cpu_blocks",
                "num_gpu_blocks",
                "engine",
            ],
            registry=r,
        )
        for e in self.engines:
            info.labels("16", "auto", "True", "0.9", "None", str(num_gpu_blocks), e).set(1)
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            registry=r,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            registry=r,
        )
        self.gpu_usage = Gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage."
            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            labels,
            registry=r,
        )
        self.usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels,
            registry=r,
        )
        self.queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        )
        self.hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=r,
        )
        self.preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            labels,
            registry=r,
        )
        Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        for e in self.engines:
            for m in (
                self.running,
                self.waiting,
                self.gpu_usage,
                self.usage,
                self.queries,
                self.hits,
                self.preemptions,
                self.ttft,
                self.tpot,
            ):
                m.labels(model, e)

    def set_usage(self, engine: int, perc: float) -> None:
        e = self.engines[engine]
        self.usage.labels(self.model, e).set(perc)
        self.gpu_usage.labels(self.model, e).set(perc)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def render_dp2_fixture() -> str:
    """The state behind `prometheus/vllm_metrics_dp2.txt`: two engines of one server."""
    ex = VllmExporter("Qwen/Qwen3-0.6B", engines=2, num_gpu_blocks=4096)
    m = ex.model
    ex.set_usage(0, 0.25)
    ex.set_usage(1, 0.75)
    ex.running.labels(m, "0").set(3)
    ex.running.labels(m, "1").set(5)
    ex.waiting.labels(m, "0").set(1)
    ex.queries.labels(m, "0").inc(1000)
    ex.queries.labels(m, "1").inc(3000)
    ex.hits.labels(m, "0").inc(250)
    ex.hits.labels(m, "1").inc(1500)
    ex.preemptions.labels(m, "0").inc(2)
    ex.preemptions.labels(m, "1").inc(7)
    for engine, seconds in (("0", 0.05), ("0", 0.3), ("1", 1.2), ("1", 0.007)):
        ex.ttft.labels(m, engine).observe(seconds)
    return ex.text()


def _without_created(text: str) -> list[str]:
    return [line for line in text.splitlines() if "_created" not in line]


def test_fixture_is_what_the_exporter_renders() -> None:
    """The checked-in text is this exporter's output (timestamps of `_created` aside)."""
    text = (FIXTURES / "vllm_metrics_dp2.txt").read_text()
    assert _without_created(text) == _without_created(render_dp2_fixture())
    assert "vllm:prefix_cache_queries_created{" in text
    assert 'vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 5.0' in text


def test_parse_fixture_data_parallel() -> None:
    r = parse_vllm_metrics((FIXTURES / "vllm_metrics_dp2.txt").read_text())
    assert r.source == "vllm"
    assert r.model == "Qwen/Qwen3-0.6B"
    # engines at 0.25 and 0.75 of equal pools: the pod is half full
    assert r.occupancy == pytest.approx(0.5)
    assert r.capacity_blocks == 2 * 4096
    assert r.used_blocks == 4096
    assert r.free_blocks == 4096
    assert r.cached_blocks is None and r.bytes_per_token is None
    assert r.block_size == 16
    assert r.prefix_cache_enabled is True
    assert (r.running, r.waiting) == (3 + 5, 1 + 0)
    assert r.prefix_queries_tokens_total == 1000 + 3000
    assert r.prefix_hits_tokens_total == 250 + 1500
    assert r.preemptions_total == 2 + 7
    assert r.ttft is not None
    assert r.ttft.count == 4 and r.ttft.sum == pytest.approx(0.05 + 0.3 + 1.2 + 0.007)
    assert r.ttft.bounds == tuple(TTFT_BUCKETS)
    assert r.ttft.counts[TTFT_BUCKETS.index(0.01)] == 1  # 0.007 <= 0.01


def test_parse_live_exporter_single_engine() -> None:
    ex = VllmExporter("meta-llama/Llama-3.1-8B-Instruct", engines=1, num_gpu_blocks=1000)
    ex.set_usage(0, 0.375)
    ex.running.labels(ex.model, "0").set(4)
    ex.queries.labels(ex.model, "0").inc(640)
    ex.hits.labels(ex.model, "0").inc(320)
    r = parse_vllm_metrics(ex.text())
    assert r.occupancy == pytest.approx(0.375)
    assert (r.capacity_blocks, r.used_blocks) == (1000, 375)
    assert r.running == 4 and r.waiting == 0 and r.preemptions_total == 0
    assert r.prefix_hits_tokens_total == 320


def test_old_vllm_names_and_no_labels() -> None:
    """vLLM v0 exported gpu_* names, no engine label and no cache_config block count."""
    text = """# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.9
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="m"} 2.0
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0
"""
    r = parse_vllm_metrics(text)
    assert r.occupancy == pytest.approx(0.9)
    assert r.capacity_blocks is None and r.used_blocks is None and r.free_blocks is None
    assert r.swapped == 2 and r.running is None
    assert r.prefix_queries_tokens_total == 10.0 and r.prefix_hits_tokens_total is None


@pytest.mark.parametrize(
    "text",
    [
        "",  # empty
        "<html><body>502 Bad Gateway</body></html>",
        '{"version": 1}',
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n",  # no KV gauge
        "vllm:kv_cache_usage_perc NaN\n",
        "vllm:kv_cache_usage_perc -0.5\n",
        'vllm:kv_cache_usage_perc{model_name="m" 0.5\n',  # broken label set
    ],
)
def test_garbage_is_rejected(text: str) -> None:
    with pytest.raises(GarbageError):
        parse_vllm_metrics(text)


async def test_sidecar_in_vllm_mode_exports_headroom_metrics() -> None:
    """Sidecar polling a live vLLM-format /metrics serves the headroom contract."""
    ex = VllmExporter("Qwen/Qwen3-0.6B", engines=1, num_gpu_blocks=2000)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=ex.text().encode(), content_type="text/plain")

    engine_app = web.Application()
    engine_app.router.add_get("/metrics", metrics)
    async with TestServer(engine_app) as engine:
        cfg = SidecarConfig(
            engine_url=str(engine.make_url("/")),
            source="vllm",
            interval=0.05,
            timeout=0.05,
            window=5.0,
            forecast_window=5.0,
        )
        async with TestServer(build_app(cfg)) as sidecar, ClientSession() as http:
            for step in range(12):
                ex.set_usage(0, 0.5 + 0.01 * step)
                ex.queries.labels(ex.model, "0").inc(100)
                ex.hits.labels(ex.model, "0").inc(50)
                await asyncio.sleep(0.06)
            async with http.get(sidecar.make_url("/metrics")) as resp:
                assert resp.status == 200
                text = await resp.text()
            async with http.get(sidecar.make_url("/saturation")) as resp:
                report = await resp.json()

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    model = (("model", "Qwen/Qwen3-0.6B"),)
    assert samples[("headroom_engine_up", model)] == 1.0
    assert samples[("headroom_kv_blocks_capacity", model)] == 2000
    occupancy = samples[("headroom_kv_block_occupancy_ratio", model)]
    assert 0.5 < occupancy <= 0.62
    used = samples[("headroom_kv_blocks", (*model, ("state", "used")))]
    assert used == round(occupancy * 2000)
    assert ("headroom_kv_blocks", (*model, ("state", "cached"))) not in samples  # vLLM: unknown
    eta = samples[("headroom_kv_saturation_eta_seconds", model)]
    assert 0 < eta < math.inf  # usage is climbing
    assert samples[("headroom_prefix_cache_hit_ratio", model)] == pytest.approx(0.5)
    assert samples[("headroom_time_to_first_token_seconds_bucket", (("le", "+Inf"), *model))] == 0
    assert report["source"] == "vllm" and report["fresh"] is True
    assert report["capacity_blocks"] == 2000
    assert report["growth_blocks_per_second"] > 0


if __name__ == "__main__":  # regenerate the fixture: .venv/bin/python tests/test_sidecar_vllm.py
    (FIXTURES / "vllm_metrics_dp2.txt").write_text(render_dp2_fixture())
