"""vLLM mode: a stock vLLM server's `/metrics` read with prometheus-client's parser.

The exposition under test is what vLLM itself produces: `VllmExporter` declares the metrics the
way vLLM v1 does (vllm/v1/metrics/loggers.py: names, help text, `model_name`/`engine` labels,
histogram buckets, `vllm:cache_config_info` as a gauge at 1) on a prometheus-client registry,
and the text is prometheus-client's own rendering, `_created` samples and all. Names changed
across releases, and the exporter declares each release's set:

- 0.9.1: old names only (`vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_queries/hits`);
- 0.10.2: the old names (help text marked DEPRECATED) beside the new ones
  (`vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries/hits`);
- 0.11.0 (the pinned image): the new names only (the gpu_* ones are hidden unless
  `--show-hidden-metrics-for-version=0.10`), and `vllm:inter_token_latency_seconds` beside
  the deprecated `vllm:time_per_output_token_seconds`;
- 0.12.0: new names only, and `vllm:inter_token_latency_seconds` in place of the hidden
  `vllm:time_per_output_token_seconds`.

`vllm:cache_config_info`'s labels are the release's CacheConfig fields plus `engine`, so the set
grows from release to release; the sets here are modelled on those fields, and the parser reads
only `block_size`, `num_gpu_blocks`, `enable_prefix_caching` and `engine`. As in vLLM, the info
series of every engine carries the same `num_gpu_blocks`: the front end's one CacheConfig, whose
count is the sum over its data-parallel engines (the engine handshake in vllm/v1/engine: "Sum
values from all engines in DP case").

The demand counters are vLLM's own: `vllm:request_success` per `finished_reason` (observed as
a request finishes in the engine), `vllm:prompt_tokens` (counted when a prompt's prefill
completes), beside the running and waiting gauges.

Checked-in renderings (run this file as a script to regenerate them):
- `prometheus/vllm_metrics_dp2.txt`: a trimmed 0.10 data-parallel (2-engine) server, equal pools
  (`render_dp2_fixture`);
- `prometheus/vllm_metrics_<version>.txt`: one server of each release above; the 0.12.0 one is
  data-parallel (`render_version_fixture`).

Several engines (`engine` label values) are several KV pools: requests, counters and histogram
buckets are summed over them. Their blocks are the one total vLLM stamps on all of them (read
once, not summed: summing it reported a data-parallel pod at twice its pool), and vLLM gives no
per-engine size, so occupancy is the plain mean of the engines' usage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_sidecar_server import next_poll, scrape_when_up

from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.poller import parse_body
from headroom.sidecar.server import build_app
from headroom.sidecar.sources import GarbageError
from headroom.sidecar.vllm_source import parse_vllm_metrics

FIXTURES = Path(__file__).parent / "prometheus"
# vLLM v1's own bucket choices for these two histograms.
# fmt: off
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
# fmt: on


VLLM_VERSIONS = ("0.9.1", "0.10.2", "0.11.0", "0.12.0")
FINISH_REASONS = ("stop", "length", "abort")  # str(FinishReason) in vllm/v1/engine

# CacheConfig fields as `vllm:cache_config_info` labels (values as vLLM's str() writes them),
# less `num_gpu_blocks` (set after the engines start) and `engine` (one series per engine).
_CACHE_FIELDS_0_9 = {
    "block_size": "16",
    "cache_dtype": "auto",
    "calculate_kv_scales": "False",
    "cpu_offload_gb": "0",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.9",
    "is_attention_free": "False",
    "num_cpu_blocks": "None",
    "num_gpu_blocks_override": "None",
    "prefix_caching_hash_algo": "builtin",
    "sliding_window": "None",
    "swap_space": "4",
    "swap_space_bytes": "4294967296",
}
_CACHE_FIELDS_0_12 = {
    "block_size": "16",
    "cache_dtype": "auto",
    "calculate_kv_scales": "False",
    "cpu_kvcache_space_bytes": "None",
    "cpu_offload_gb": "0.0",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.9",
    "is_attention_free": "False",
    "kv_cache_memory_bytes": "None",
    "kv_offloading_backend": "None",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "auto",
    "num_cpu_blocks": "None",
    "num_gpu_blocks_override": "None",
    "prefix_caching_hash_algo": "sha256",
    "sliding_window": "None",
    "swap_space": "4",
}
CACHE_FIELDS: dict[str, dict[str, str]] = {
    "0.9.1": _CACHE_FIELDS_0_9,
    "0.10.2": {
        **_CACHE_FIELDS_0_9,
        "kv_sharing_fast_prefill": "False",
        "mamba_page_size_padded": "None",
    },
    # 0.11.0's set is taken as 0.12.0's: the labels the parser reads are in both.
    "0.11.0": _CACHE_FIELDS_0_12,
    "0.12.0": _CACHE_FIELDS_0_12,
}
# The label set of the (older, trimmed) dp2 fixture.
DP2_CACHE_FIELDS = {
    "block_size": "16",
    "cache_dtype": "auto",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.9",
    "num_cpu_blocks": "None",
}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


class VllmExporter:
    """vLLM v1's Prometheus metrics, declared as release `version` declares them, on a private
    registry. `num_gpu_blocks` is each engine's pool (one count for all, or one per engine);
    what the info series carry is their sum, on every engine, as vLLM's front end stamps it."""

    def __init__(
        self,
        model: str,
        engines: int = 1,
        num_gpu_blocks: int | Sequence[int] = 4096,
        version: str = "0.10.2",
        cache_fields: dict[str, str] | None = None,
        deprecated_prefix_counters: bool | None = None,
    ) -> None:
        release = _release(version)
        old_names = release < (0, 11)  # gpu_* names: hidden in 0.11, gone in 0.12
        new_names = release >= (0, 10)
        if deprecated_prefix_counters is None:
            deprecated_prefix_counters = old_names
        self.registry = CollectorRegistry()
        self.model = model
        self.engines = [str(i) for i in range(engines)]
        blocks = (
            [num_gpu_blocks] * engines if isinstance(num_gpu_blocks, int) else list(num_gpu_blocks)
        )
        labels = ["model_name", "engine"]
        r = self.registry
        fields = CACHE_FIELDS[version] if cache_fields is None else cache_fields
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*fields, "num_gpu_blocks", "engine"],
            registry=r,
        )
        assert len(blocks) == engines
        for e in self.engines:
            info.labels(**fields, num_gpu_blocks=str(sum(blocks)), engine=e).set(1)
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
        deprecated = new_names  # from 0.10 the old names' help says so
        self.gpu_usage = self.gpu_queries = self.gpu_hits = None
        if old_names:
            self.gpu_usage = Gauge(
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage."
                + ("DEPRECATED: Use vllm:kv_cache_usage_perc instead." if deprecated else ""),
                labels,
                registry=r,
            )
        if old_names and deprecated_prefix_counters:
            self.gpu_queries = Counter(
                "vllm:gpu_prefix_cache_queries",
                "GPU prefix cache queries, in terms of number of queried"
                + (
                    "tokens. DEPRECATED: Use vllm:prefix_cache_queries instead."
                    if deprecated
                    else " tokens."
                ),
                labels,
                registry=r,
            )
            self.gpu_hits = Counter(
                "vllm:gpu_prefix_cache_hits",
                "GPU prefix cache hits, in terms of number of cached tokens."
                + (" DEPRECATED: Use vllm:prefix_cache_hits instead." if deprecated else ""),
                labels,
                registry=r,
            )
        self.usage = self.queries = self.hits = None
        if new_names:
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
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        for e in self.engines:  # vLLM creates every (engine, reason) series up front
            for reason in FINISH_REASONS:
                self.success.labels(model, e, reason)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot_names: list[Histogram] = []
        if release < (0, 12):  # deprecated in 0.11, hidden in 0.12
            self.tpot = Histogram(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds.",
                labels,
                buckets=TPOT_BUCKETS,
                registry=r,
            )
            self.tpot_names.append(self.tpot)
        if release >= (0, 11):  # its new name
            self.tpot = Histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                labels,
                buckets=TPOT_BUCKETS,
                registry=r,
            )
            self.tpot_names.append(self.tpot)
            Histogram(
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                labels,
                buckets=TPOT_BUCKETS,
                registry=r,
            )
        metrics = [
            self.running,
            self.waiting,
            self.gpu_usage,
            self.gpu_queries,
            self.gpu_hits,
            self.usage,
            self.queries,
            self.hits,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            *self.tpot_names,
        ]
        for e in self.engines:
            for m in metrics:
                if m is not None:
                    m.labels(model, e)

    def set_usage(self, engine: int, perc: float) -> None:
        e = self.engines[engine]
        for gauge in (self.usage, self.gpu_usage):
            if gauge is not None:
                gauge.labels(self.model, e).set(perc)

    def add_prefix(self, engine: int, queries: float, hits: float) -> None:
        """Count prefix-cache tokens under every name this release exports."""
        e = self.engines[engine]
        for counter, n in (
            (self.queries, queries),
            (self.gpu_queries, queries),
            (self.hits, hits),
            (self.gpu_hits, hits),
        ):
            if counter is not None:
                counter.labels(self.model, e).inc(n)

    def prefill(self, engine: int, prompt_tokens: int) -> None:
        """A prompt's prefill completes (its first token): vLLM counts its prompt tokens."""
        self.prompt_tokens.labels(self.model, self.engines[engine]).inc(prompt_tokens)

    def finish(self, engine: int, reason: str = "stop", generated: int = 0) -> None:
        """A request finishes in the engine."""
        e = self.engines[engine]
        self.success.labels(self.model, e, reason).inc()
        self.generation_tokens.labels(self.model, e).inc(generated)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def render_dp2_fixture() -> str:
    """The state behind `prometheus/vllm_metrics_dp2.txt`: two engines of one server."""
    ex = VllmExporter(
        "Qwen/Qwen3-0.6B",
        engines=2,
        num_gpu_blocks=2048,
        cache_fields=DP2_CACHE_FIELDS,
        deprecated_prefix_counters=False,
    )
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


def render_version_fixture(version: str) -> str:
    """The state behind `prometheus/vllm_metrics_<version>.txt`.

    0.9.1, 0.10.2 and 0.11.0: one engine of 2048 blocks at 0.375; 8 requests have had their prefill
    (800 prompt tokens), 5 have finished (4 stop, 1 length), 1 runs and 2 wait. 0.12.0: two
    data-parallel engines of 3000 blocks (6000 stamped on both) at 0.5 and 0.3; 12 finished,
    9 run, 3 wait.
    """
    if _release(version) < (0, 12):
        ex = VllmExporter("meta-llama/Llama-3.1-8B-Instruct", 1, 2048, version=version)
        ex.set_usage(0, 0.375)
        ex.running.labels(ex.model, "0").set(6)
        ex.waiting.labels(ex.model, "0").set(2)
        ex.add_prefix(0, queries=800, hits=200)
        ex.preemptions.labels(ex.model, "0").inc(3)
        ex.prefill(0, 800)
        for reason in ("stop", "stop", "stop", "stop", "length"):
            ex.finish(0, reason, generated=100)
        observations = [("0", 0.03, 0.02), ("0", 0.6, 0.04)]
    else:
        ex = VllmExporter("Qwen/Qwen3-8B", 2, 3000, version=version)
        ex.set_usage(0, 0.5)
        ex.set_usage(1, 0.3)
        for engine, running, waiting in (("0", 7, 3), ("1", 2, 0)):
            ex.running.labels(ex.model, engine).set(running)
            ex.waiting.labels(ex.model, engine).set(waiting)
        ex.add_prefix(0, queries=5000, hits=4000)
        ex.add_prefix(1, queries=1000, hits=0)
        ex.preemptions.labels(ex.model, "0").inc(4)
        ex.prefill(0, 5000)
        ex.prefill(1, 1000)
        for index, finished in ((0, 8), (1, 3)):
            for _ in range(finished):
                ex.finish(index, "stop", generated=50)
        ex.finish(1, "abort")
        observations = [("0", 0.03, 0.02), ("1", 0.6, 0.04), ("1", 3.0, 0.3)]
    for engine, ttft, tpot in observations:
        ex.ttft.labels(ex.model, engine).observe(ttft)
        for histogram in ex.tpot_names:  # 0.11 observes both names
            histogram.labels(ex.model, engine).observe(tpot)
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
    # engines at 0.25 and 0.75 of equal pools: the pod is half full; 4096 is the pod's pool
    # (two engines of 2048), stamped on both engines' info series, not 2 x 4096
    assert r.occupancy == pytest.approx(0.5)
    assert r.capacity_blocks == 4096
    assert r.used_blocks == 2048
    assert r.free_blocks == 2048
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


def test_a_usage_gauge_far_above_one_is_garbage_not_a_full_pool() -> None:
    # `_perc` in the name, a share in the value: an exporter's 37.5 read as a full pool.
    text = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 37.5\n'
    with pytest.raises(GarbageError, match="not a fraction"):
        parse_vllm_metrics(text)
    ok = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1.01\n'
    assert parse_vllm_metrics(ok).occupancy == 1.0


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_version_fixture_is_what_the_exporter_renders(version: str) -> None:
    text = (FIXTURES / f"vllm_metrics_{version}.txt").read_text()
    assert _without_created(text) == _without_created(render_version_fixture(version))


def _names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_vllm_0_9_1_old_names_only() -> None:
    text = (FIXTURES / "vllm_metrics_0.9.1.txt").read_text()
    names = _names(text)
    assert "vllm:gpu_cache_usage_perc" in names and "vllm:kv_cache_usage_perc" not in names
    assert "vllm:gpu_prefix_cache_queries_total" in names
    assert "vllm:prefix_cache_queries_total" not in names
    r = parse_vllm_metrics(text)
    assert r.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert r.occupancy == pytest.approx(0.375)
    assert (r.capacity_blocks, r.used_blocks, r.free_blocks) == (2048, 768, 1280)
    assert r.block_size == 16 and r.prefix_cache_enabled is True
    assert (r.prefix_queries_tokens_total, r.prefix_hits_tokens_total) == (800, 200)
    assert (r.running, r.waiting, r.swapped, r.preemptions_total) == (6, 2, None, 3)
    assert r.ttft is not None and r.ttft.count == 2
    assert r.tpot is not None and r.tpot.count == 2
    assert r.tpot.bounds == tuple(TPOT_BUCKETS)


def test_vllm_0_10_both_names_read_the_new_ones() -> None:
    text = (FIXTURES / "vllm_metrics_0.10.2.txt").read_text()
    names = _names(text)
    for new_name, old_name in (
        ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
        ("prefix_cache_queries_total", "gpu_prefix_cache_queries_total"),
        ("prefix_cache_hits_total", "gpu_prefix_cache_hits_total"),
    ):
        assert {f"vllm:{new_name}", f"vllm:{old_name}"} <= names
    assert parse_vllm_metrics(text) == parse_vllm_metrics(
        (FIXTURES / "vllm_metrics_0.9.1.txt").read_text()
    )
    # Where the two disagree, the new name is the one read.
    ex = VllmExporter("m", 1, 1000, version="0.10.2")
    assert ex.usage is not None and ex.gpu_usage is not None
    assert ex.queries is not None and ex.gpu_queries is not None
    ex.usage.labels("m", "0").set(0.25)
    ex.gpu_usage.labels("m", "0").set(0.9)
    ex.queries.labels("m", "0").inc(10)
    ex.gpu_queries.labels("m", "0").inc(99)
    r = parse_vllm_metrics(ex.text())
    assert r.occupancy == pytest.approx(0.25) and r.used_blocks == 250
    assert r.prefix_queries_tokens_total == 10


def test_vllm_0_11_the_pinned_image_hides_the_old_names() -> None:
    text = (FIXTURES / "vllm_metrics_0.11.0.txt").read_text()
    names = _names(text)
    assert not any(n.startswith("vllm:gpu_") for n in names)
    assert "vllm:time_per_output_token_seconds_bucket" in names  # deprecated, still shown
    assert "vllm:inter_token_latency_seconds_bucket" in names
    # the same server state reads the same under every release's names
    assert parse_vllm_metrics(text) == parse_vllm_metrics(
        (FIXTURES / "vllm_metrics_0.9.1.txt").read_text()
    )


def test_vllm_0_12_new_names_only_data_parallel() -> None:
    text = (FIXTURES / "vllm_metrics_0.12.0.txt").read_text()
    names = _names(text)
    assert not any(n.startswith("vllm:gpu_") for n in names)
    assert "vllm:time_per_output_token_seconds_bucket" not in names
    assert "vllm:inter_token_latency_seconds_bucket" in names
    r = parse_vllm_metrics(text)
    assert r.model == "Qwen/Qwen3-8B"
    # two engines of 3000 blocks at 0.5 and 0.3: 2400 of 6000 blocks are used
    assert r.capacity_blocks == 6000
    assert r.used_blocks == 2400 and r.free_blocks == 3600
    assert r.occupancy == pytest.approx(0.4)
    assert (r.running, r.waiting, r.preemptions_total) == (7 + 2, 3 + 0, 4)
    assert (r.prefix_queries_tokens_total, r.prefix_hits_tokens_total) == (6000, 4000)
    assert r.block_size == 16 and r.prefix_cache_enabled is True
    assert r.ttft is not None and r.ttft.count == 3
    assert r.ttft.sum == pytest.approx(0.03 + 0.6 + 3.0)
    # the TPOT histogram is read under its 0.12 name, inter-token latency, summed over engines
    assert r.tpot is not None and r.tpot.count == 3
    assert r.tpot.sum == pytest.approx(0.02 + 0.04 + 0.3)
    assert r.tpot.counts[TPOT_BUCKETS.index(0.025)] == 1


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_cache_config_info_label_set_by_version(version: str) -> None:
    """Whatever else the release puts in cache_config_info, the four labels read are found."""
    text = (FIXTURES / f"vllm_metrics_{version}.txt").read_text()
    info = [
        s.labels
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:cache_config_info"
    ]
    assert info and all(
        set(labels) == {*CACHE_FIELDS[version], "num_gpu_blocks", "engine"} for labels in info
    )
    r = parse_vllm_metrics(text)
    assert r.block_size == 16 and r.prefix_cache_enabled is True
    stamped = {labels["num_gpu_blocks"] for labels in info}
    assert len(stamped) == 1  # one total on every engine's series
    assert r.capacity_blocks == int(stamped.pop())


def _info(labels: str) -> str:
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{labels}}} 1.0\n"
    )


_USAGE_TWO_ENGINES = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.2
"""


@pytest.mark.parametrize(
    ("config", "capacity", "occupancy"),
    [
        # the front end's total on each engine's series: the pod's pool, read once
        (
            'block_size="16",engine="0",num_gpu_blocks="4000"} 1.0\n'
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="4000"',
            4000,
            0.35,
        ),
        # counts that differ are no vLLM release's rendering: sizes unknown, not guessed
        (
            'block_size="16",engine="0",num_gpu_blocks="3000"} 1.0\n'
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"',
            None,
            0.35,
        ),
        # no block count for one engine: sizes unknown, the plain mean of the two
        (
            'block_size="16",engine="0",num_gpu_blocks="3000"} 1.0\n'
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="None"',
            None,
            0.35,
        ),
        # one series without an `engine` label for two engines: which pool is it? unknown
        ('block_size="16",num_gpu_blocks="3000"', None, 0.35),
        # two series for one engine: ambiguous, unknown
        (
            'block_size="16",engine="0",num_gpu_blocks="3000"} 1.0\n'
            'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="1000"',
            None,
            0.35,
        ),
        # any positive count is a pool, the smallest included
        (
            'block_size="16",engine="0",num_gpu_blocks="1"} 1.0\n'
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1"',
            1,
            0.35,
        ),
        # the same count on both, but no pool's (0 blocks, or the label before it is set)
        (
            'block_size="16",engine="0",num_gpu_blocks="0"} 1.0\n'
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="0"',
            None,
            0.35,
        ),
        (
            'block_size="16",engine="0",num_gpu_blocks="None"} 1.0\n'
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="None"',
            None,
            0.35,
        ),
    ],
)
def test_engines_pair_with_their_cache_config(
    config: str, capacity: int | None, occupancy: float
) -> None:
    r = parse_vllm_metrics(_USAGE_TWO_ENGINES + _info(config))
    assert r.capacity_blocks == capacity
    assert r.occupancy == pytest.approx(occupancy)
    assert (r.used_blocks is None) == (capacity is None)
    if capacity is not None:
        assert r.used_blocks == round(occupancy * capacity)


def test_v0_engine_config_without_engine_label_pairs_with_the_one_engine() -> None:
    """vLLM's v0 engine: no `engine` label anywhere, cache_config_info with its v0 fields."""
    text = (
        _info(
            'block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",'
            'enable_prefix_caching="False",gpu_memory_utilization="0.9",'
            'is_attention_free="False",num_cpu_blocks="9362",num_gpu_blocks="81767",'
            'num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"'
        )
        + '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
    )
    r = parse_vllm_metrics(text)
    assert (r.capacity_blocks, r.used_blocks) == (81767, round(0.5 * 81767))
    assert r.prefix_cache_enabled is False
    # ... and with the v1 label on the usage side only, the single pair still matches
    r = parse_vllm_metrics(text.replace('{model_name="m"}', '{engine="0",model_name="m"}'))
    assert r.capacity_blocks == 81767


def test_engines_counters_and_histograms_are_summed() -> None:
    ex = VllmExporter("m", engines=3, num_gpu_blocks=200, version="0.12.0")
    for i, (perc, queries, hits, preempted) in enumerate(
        [(0.1, 10, 1, 0), (0.2, 20, 2, 5), (0.3, 30, 3, 7)]
    ):
        ex.set_usage(i, perc)
        ex.add_prefix(i, queries, hits)
        ex.preemptions.labels("m", str(i)).inc(preempted)
        ex.running.labels("m", str(i)).set(i + 1)
        ex.ttft.labels("m", str(i)).observe(0.05 * (i + 1))
        ex.prefill(i, 100 * (i + 1))
        for _ in range(i + 1):
            ex.finish(i, "length")
    r = parse_vllm_metrics(ex.text())
    assert r.capacity_blocks == 600  # three engines of 200: the stamped 600, once
    assert r.used_blocks == 20 + 40 + 60
    assert r.occupancy == pytest.approx(120 / 600)
    assert (r.prefix_queries_tokens_total, r.prefix_hits_tokens_total) == (60, 6)
    assert (r.preemptions_total, r.running, r.waiting) == (12, 6, 0)
    assert r.ttft is not None and r.ttft.count == 3
    assert r.ttft.sum == pytest.approx(0.3)
    assert r.requests_departed_total == 1 + 2 + 3
    assert r.requests_arrived_total == 6 + 6  # departed + running + waiting
    assert r.prompt_tokens_arrived_total == 600


def test_data_parallel_pool_is_not_counted_once_per_engine() -> None:
    """vLLM stamps the sum of its engines' blocks on every engine's info series: a pod of two
    engines of 5000 blocks has 10,000 blocks, not 20,000 (issue 22), and half of them are used
    when both engines are half full."""
    ex = VllmExporter("m", engines=2, num_gpu_blocks=5000, version="0.10.2")
    info = [
        s.labels
        for f in text_string_to_metric_families(ex.text())
        for s in f.samples
        if s.name == "vllm:cache_config_info"
    ]
    assert [labels["num_gpu_blocks"] for labels in info] == ["10000", "10000"]
    for engine in (0, 1):
        ex.set_usage(engine, 0.5)
    r = parse_vllm_metrics(ex.text())
    assert (r.capacity_blocks, r.used_blocks, r.free_blocks) == (10000, 5000, 5000)
    assert r.occupancy == pytest.approx(0.5)


def test_unequal_data_parallel_pools_read_as_equal() -> None:
    """vLLM exports no per-engine pool size, so engines of 4000 blocks at 0.5 and 2000 at 0.2
    (2400 of 6000 used, 0.4) read as the plain mean of their usage, 0.35: a limit of what
    vLLM exports. Its data-parallel engines run one model on like GPUs, so their pools match
    in practice."""
    ex = VllmExporter("m", engines=2, num_gpu_blocks=(4000, 2000), version="0.12.0")
    ex.set_usage(0, 0.5)
    ex.set_usage(1, 0.2)
    r = parse_vllm_metrics(ex.text())
    assert r.capacity_blocks == 6000
    assert r.occupancy == pytest.approx(0.35)
    assert r.used_blocks == 2100


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_demand_counters_by_release(version: str) -> None:
    """Departures are request_success over every finished_reason and engine; arrivals are
    departures plus the requests running and waiting; prompt tokens are counted at prefill;
    vLLM exports no block-seconds (the sidecar integrates them)."""
    r = parse_vllm_metrics((FIXTURES / f"vllm_metrics_{version}.txt").read_text())
    if _release(version) < (0, 12):
        departed, in_flight, prompt = 5, 6 + 2, 800
    else:
        departed, in_flight, prompt = 8 + 3 + 1, 9 + 3, 6000
    assert r.requests_departed_total == departed
    assert r.requests_arrived_total == departed + in_flight
    assert r.prompt_tokens_arrived_total == prompt
    assert r.kv_block_seconds_total is None


def test_no_request_counter_no_arrivals() -> None:
    text = "vllm:kv_cache_usage_perc 0.5\nvllm:num_requests_running 3\n"
    r = parse_vllm_metrics(text)
    assert r.requests_departed_total is None and r.requests_arrived_total is None
    assert r.prompt_tokens_arrived_total is None


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
        "vllm:kv_cache_usage_perc 0.5\nvllm:num_requests_running -3\n",
        "vllm:kv_cache_usage_perc 0.5\nvllm:prefix_cache_hits_total +Inf\n",
        "vllm:kv_cache_usage_perc 0.5\n"  # no +Inf bucket
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} 1\n',
        "vllm:kv_cache_usage_perc 0.5\n"  # counts that fall
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} 3\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 1\n',
        "vllm:kv_cache_usage_perc 0.5\n"  # a bound that is not a number
        'vllm:time_to_first_token_seconds_bucket{le="soon"} 1\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 1\n',
        b"\xff\xfe not utf-8",
        "vllm:kv_cache_usage_perc 0.5\n"  # a histogram sum below zero
        'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 1\n'
        "vllm:time_to_first_token_seconds_sum -5\n",
        "vllm:kv_cache_usage_perc 0.5\n"  # ... or not a number
        'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 1\n'
        "vllm:time_to_first_token_seconds_sum NaN\n",
        "vllm:kv_cache_usage_perc 0.5\n"  # a bucket count that is not a number
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} NaN\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 1\n',
    ],
)
def test_garbage_is_rejected(text: str | bytes) -> None:
    body = text if isinstance(text, bytes) else text.encode()
    with pytest.raises(GarbageError):
        parse_body("vllm", body)
    if isinstance(text, str):
        with pytest.raises(GarbageError):
            parse_vllm_metrics(text)


@pytest.mark.parametrize(
    "text",
    [
        # the same series twice with different values: Prometheus refuses such a scrape, and
        # an average of the two (0.6625) would be a number no engine reported
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"}'
        ' 0.375\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.95\n',
        "vllm:kv_cache_usage_perc 0.375\nvllm:kv_cache_usage_perc 0.95\n",
        # ... or with the same value, and label order does not make two series different
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.5\n',
        # a duplicated counter would be summed twice
        'vllm:kv_cache_usage_perc 0.5\nvllm:num_preemptions_total{engine="0"} 3\n'
        'vllm:num_preemptions_total{engine="0"} 3\n',
    ],
)
def test_duplicate_series_are_garbage_not_averaged(text: str) -> None:
    with pytest.raises(GarbageError, match="duplicate series"):
        parse_vllm_metrics(text)


async def test_sidecar_in_vllm_mode_exports_headroom_metrics() -> None:
    """Sidecar polling a live vLLM-format /metrics serves the headroom contract."""
    ex = VllmExporter("Qwen/Qwen3-0.6B", engines=1, num_gpu_blocks=2000)
    served = 0

    async def metrics(_: web.Request) -> web.Response:
        nonlocal served
        served += 1
        return web.Response(body=ex.text().encode(), content_type="text/plain")

    engine_app = web.Application()
    engine_app.router.add_get("/metrics", metrics)
    async with TestServer(engine_app) as engine:
        cfg = SidecarConfig(
            engine_url=str(engine.make_url("/")),
            source="vllm",
            interval=0.1,
            timeout=0.1,
            window=5.0,
            forecast_window=5.0,
            planned_blocks=2048,
        )
        async with TestServer(build_app(cfg)) as sidecar, ClientSession() as http:
            for step in range(14):
                ex.set_usage(0, 0.5 + 0.01 * step)
                ex.queries.labels(ex.model, "0").inc(100)
                ex.hits.labels(ex.model, "0").inc(50)
                # requests arrive at steps 0-11 and each runs for two steps
                if step < 12:
                    ex.prefill(0, 100)
                if step >= 2:
                    ex.finish(0, generated=10)
                ex.running.labels(ex.model, "0").set(min(step + 1, 12) - max(step - 1, 0))
                await next_poll(lambda: served)  # the sidecar reads each step
            # One more poll begun: the one that read the last step is recorded. A body that
            # says the engine is up from now on shows the end state, however the test's process
            # was paused (a poll that timed out, a reading gone stale).
            await next_poll(lambda: served)
            text, report = await scrape_when_up(http, sidecar)

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    model = (("model", "Qwen/Qwen3-0.6B"),)
    assert samples[("headroom_engine_up", model)] == 1.0
    assert samples[("headroom_kv_blocks_capacity", model)] == 2000
    # the plan the operator passed, beside the pool vLLM runs (here 48 blocks short of it)
    assert samples[("headroom_kv_blocks_planned", model)] == 2048
    # the demand counters: 12 finished, none in flight at the end, 1,200 prompt tokens
    assert samples[("headroom_requests_departed_total", model)] == 12
    assert samples[("headroom_requests_arrived_total", model)] == 12
    assert samples[("headroom_prompt_tokens_arrived_total", model)] == 1200
    assert samples[("headroom_kv_block_seconds_total", model)] > 0  # integrated by the sidecar
    occupancy = samples[("headroom_kv_block_occupancy_ratio", model)]
    assert 0.5 < occupancy <= 0.64
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


if __name__ == "__main__":  # regenerate the fixtures: .venv/bin/python tests/test_sidecar_vllm.py
    # (only `_created` timestamps change when the exporter does not)
    (FIXTURES / "vllm_metrics_dp2.txt").write_text(render_dp2_fixture())
    for v in VLLM_VERSIONS:
        (FIXTURES / f"vllm_metrics_{v}.txt").write_text(render_version_fixture(v))
