"""SGLang mode: a stock SGLang server's `/metrics` (`--enable-metrics`) read as one pod.

The exposition under test is what SGLang itself produces. SGLang runs prometheus-client in
multiprocess mode: every scheduler process (one per rank) and the tokenizer manager writes its
metrics to files under `PROMETHEUS_MULTIPROC_DIR`, and `/metrics` is a `MultiProcessCollector`
over them. `SglangServer` does the same: each `scheduler()` / `tokenizer()` is a process of its
own (its own multiprocess value class and pid), declaring the metrics the way
sglang/srt/metrics/collector.py does (names, help text, `multiprocess_mode`, buckets), with
SGLang's scheduler labels (`model_name`, `engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank`,
and `dp_rank` under data-parallel attention). The text is prometheus-client's own rendering:
no `_created` samples, and a `pid` label on `sglang:num_retracted_reqs`, the one gauge SGLang
declares without a `multiprocess_mode`.

Checked-in renderings (run this file as a script to regenerate them):
- `prometheus/sglang_metrics_0.5.3.txt` (`render_053_fixture`): one scheduler of the pinned
  release, 0.5.3, whose scheduler exports no `sglang:max_total_num_tokens` and no retraction
  total, only the gauge `sglang:num_retracted_reqs` of the requests retracted since its last
  stats log (reset at every log; the counter `sglang:num_retracted_requests_total` came in
  0.5.7); beside it
  `prometheus/sglang_server_info_0.5.3.json`, its `GET /get_server_info` answer, trimmed to
  the fields around those the sidecar reads (the real body carries every ServerArgs field);
- `prometheus/sglang_metrics_tp1.txt`: one scheduler (`render_tp1_fixture`);
- `prometheus/sglang_metrics_dp2_tp4.txt`: data-parallel attention, dp 2 x tp 4 with
  `--enable-metrics-for-all-schedulers`, four scheduler ranks and two KV pools
  (`render_dp2_tp4_fixture`);
- `prometheus/sglang_metrics_legacy.txt`: hand-written after the example in SGLang's
  production-metrics docs of an early release (`model_name` the only label, no
  `sglang:max_total_num_tokens`, `sglang:time_per_output_token_seconds`).

The rules under test: blocks = tokens // `--page-size`; ranks of one pool (same labels but for
`*_rank` other than `dp_rank`, and `pid`) are read from the lowest rank only, never added up;
distinct `dp_rank` pools are added up, occupancy being their capacity-weighted mean usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from test_sidecar_server import next_poll, scrape_when_up

from headroom.sidecar.cli import config_from_args, configure_parser
from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.poller import parse_body
from headroom.sidecar.server import build_app
from headroom.sidecar.sglang_source import (
    SglangServerInfo,
    parse_sglang_metrics,
    parse_sglang_server_info,
)
from headroom.sidecar.sources import GarbageError

FIXTURES = Path(__file__).parent / "prometheus"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# SGLang's TokenizerMetricsCollector defaults.
# fmt: off
TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
ITL_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000,
               8.000]
E2E_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400]
# fmt: on

# SchedulerMetricsCollector's gauges read here (and two that are not), as SGLang declares them.
SCHEDULER_GAUGES = {
    "num_running_reqs": ("sglang:num_running_reqs", "The number of running requests."),
    "num_used_tokens": ("sglang:num_used_tokens", "The number of used tokens."),
    "token_usage": ("sglang:token_usage", "The token usage."),
    "gen_throughput": ("sglang:gen_throughput", "The generation throughput (token/s)."),
    "num_queue_reqs": ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
    "cache_hit_rate": ("sglang:cache_hit_rate", "The prefix cache hit rate."),
    "max_total_num_tokens": (
        "sglang:max_total_num_tokens",
        "Maximum total number of tokens in the KV cache pool.",
    ),
}


# 0.5.3's SchedulerMetricsCollector (sglang/srt/metrics/collector.py): no pool-size gauge, no
# retraction total (only the per-log `sglang:num_retracted_reqs`), and the grammar queue.
SCHEDULER_GAUGES_053 = {
    **{k: v for k, v in SCHEDULER_GAUGES.items() if k != "max_total_num_tokens"},
    "num_grammar_queue_reqs": (
        "sglang:num_grammar_queue_reqs",
        "The number of requests in the grammar waiting queue.",
    ),
}


class Scheduler:
    """One scheduler process's SchedulerMetricsCollector (the part the sidecar reads), as a
    later release (0.5.7 on, with the retraction counter) declares it, or as 0.5.3 does
    (`release="0.5.3"`)."""

    def __init__(self, labels: dict[str, str], release: str = "later") -> None:
        names = list(labels)
        self.release = release
        declared = SCHEDULER_GAUGES_053 if release == "0.5.3" else SCHEDULER_GAUGES
        self.gauges = {
            key: Gauge(name, doc, names, multiprocess_mode="mostrecent", registry=None).labels(
                **labels
            )
            for key, (name, doc) in declared.items()
        }
        # Declared without a multiprocess_mode, so prometheus-client's default, "all": one
        # series per process, with a `pid` label.
        self.retracted_gauge = Gauge(
            "sglang:num_retracted_reqs",
            "The number of retracted requests.",
            names,
            registry=None,
        ).labels(**labels)
        self.retracted = (
            None
            if release == "0.5.3"
            else Counter(
                "sglang:num_retracted_requests_total",
                "Total number of retracted requests.",
                names,
                registry=None,
            ).labels(**labels)
        )

    def log_stats(self, **stats: float) -> None:
        """`SchedulerMetricsCollector.log_stats`: every gauge at once, retractions since the
        last log into the gauge (and into the counter, which 0.5.3 does not have)."""
        for key, value in stats.items():
            if key == "num_retracted_reqs":
                self.retracted_gauge.set(value)
                if self.retracted is not None:
                    self.retracted.inc(value)
            else:
                self.gauges[key].set(value)


class Tokenizer:
    """The tokenizer manager's TokenizerMetricsCollector (labels: `model_name`)."""

    def __init__(
        self,
        model: str,
        process: Callable[[], contextlib.AbstractContextManager[None]],
        tpot_name: str = "sglang:inter_token_latency_seconds",
    ) -> None:
        labels = {"model_name": model}
        names = list(labels)
        self._labels, self._process = labels, process

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=None).labels(**labels)

        def histogram(name: str, doc: str, buckets: list[float]) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=None).labels(**labels)

        self.prompt_tokens = counter(
            "sglang:prompt_tokens_total", "Number of prefill tokens processed."
        )
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed."
        )
        # SGLang creates this series only at the first request that had a cached token.
        self._cached_family = Counter(
            "sglang:cached_tokens_total", "Number of cached prompt tokens.", names, registry=None
        )
        self.cached_tokens: Any = None
        self.requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.aborted = counter("sglang:num_aborted_requests_total", "Number of requests aborted.")
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(tpot_name, "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            E2E_BUCKETS,
        )

    def finish(self, prompt: int, cached: int, generated: int, ttft: float, itl: float) -> None:
        """One finished request, as `observe_one_finished_request` counts it."""
        self.prompt_tokens.inc(prompt)
        if cached > 0:
            if self.cached_tokens is None:
                with self._process():
                    self.cached_tokens = self._cached_family.labels(**self._labels)
            self.cached_tokens.inc(cached)
        self.generation_tokens.inc(generated)
        self.requests.inc()
        self.ttft.observe(ttft)
        self.itl.observe(itl)
        self.e2e.observe(ttft + generated * itl)


class SglangServer:
    """SGLang's processes writing metrics to one multiprocess directory, and its /metrics."""

    def __init__(self, directory: Path, model: str = MODEL) -> None:
        self.directory = directory
        self.model = model
        self._next_pid = 4100

    @contextlib.contextmanager
    def _process(self) -> Iterator[None]:
        """Metrics created inside write to a process's own files, as a separate pid would."""
        pid = self._next_pid
        self._next_pid += 1
        saved = values.ValueClass
        saved_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        values.ValueClass = values.MultiProcessValue(lambda: pid)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self.directory)
        try:
            yield
        finally:
            values.ValueClass = saved
            if saved_dir is None:
                del os.environ["PROMETHEUS_MULTIPROC_DIR"]
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved_dir

    def scheduler(
        self,
        tp_rank: int = 0,
        pp_rank: int = 0,
        dp_rank: int | None = None,
        release: str = "later",
        **extra: str,
    ) -> Scheduler:
        labels = {
            "model_name": self.model,
            "engine_type": "unified",
            "tp_rank": str(tp_rank),
            "pp_rank": str(pp_rank),
            **extra,
        }
        if dp_rank is not None:
            labels["dp_rank"] = str(dp_rank)
        with self._process():
            return Scheduler(labels, release)

    def tokenizer(self, **kwargs: Any) -> Tokenizer:
        with self._process():
            return Tokenizer(self.model, self._process, **kwargs)

    def text(self) -> str:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.directory))
        return generate_latest(registry).decode()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SglangServer]:
    yield SglangServer(tmp_path)
    values.close_all_multiprocess_files()


def render_tp1_fixture(directory: Path) -> str:
    """One scheduler, 262,144 tokens, a quarter used."""
    srv = SglangServer(directory)
    sched = srv.scheduler(moe_ep_rank="0")
    tok = srv.tokenizer()
    sched.log_stats(
        max_total_num_tokens=262144,
        num_used_tokens=65536,
        token_usage=0.25,
        num_running_reqs=12,
        num_queue_reqs=3,
        cache_hit_rate=0.4,
        gen_throughput=1830.5,
        num_retracted_reqs=2,
    )
    sched.log_stats(num_retracted_reqs=0)  # the next log: none retracted since
    tok.finish(prompt=900, cached=600, generated=120, ttft=0.15, itl=0.012)
    tok.finish(prompt=1100, cached=0, generated=80, ttft=0.9, itl=0.03)
    return srv.text()


def render_dp2_tp4_fixture(directory: Path) -> str:
    """dp 2 x tp 4 (attention tp 2), every scheduler exporting. Pool 0 (tp ranks 0, 1) is half
    full, pool 1 (tp ranks 2, 3) a quarter; tp rank 1 logged a moment after rank 0 and reports
    slightly different figures for the same pool, which the sidecar must not read."""
    srv = SglangServer(directory)
    pools = [
        (0, [(0, 0.5, 10, 4), (1, 0.52, 11, 5)]),
        (1, [(2, 0.25, 6, 0), (3, 0.25, 6, 0)]),
    ]
    retracted = {0: 3, 1: 1}
    for dp_rank, ranks in pools:
        for tp_rank, usage, running, queued in ranks:
            sched = srv.scheduler(tp_rank=tp_rank, dp_rank=dp_rank, moe_ep_rank=str(tp_rank))
            sched.log_stats(
                max_total_num_tokens=131072,
                num_used_tokens=round(usage * 131072),
                token_usage=usage,
                num_running_reqs=running,
                num_queue_reqs=queued,
                cache_hit_rate=0.0,
                gen_throughput=900.0,
                num_retracted_reqs=retracted[dp_rank],
            )
    tok = srv.tokenizer()
    tok.finish(prompt=4000, cached=3000, generated=200, ttft=0.3, itl=0.02)
    tok.finish(prompt=2000, cached=1000, generated=100, ttft=0.5, itl=0.025)
    tok.finish(prompt=1000, cached=0, generated=50, ttft=2.5, itl=0.05)
    return srv.text()


def render_053_fixture(directory: Path) -> str:
    """SGLang 0.5.3, one scheduler, page size 16: 3,584 of 14,336 tokens used (a quarter); 2
    requests retracted, which only one log's gauge showed; 5 finished, 4 running, 1 queued, 1
    waiting for its grammar."""
    srv = SglangServer(directory)
    sched = srv.scheduler(release="0.5.3")
    tok = srv.tokenizer()
    sched.log_stats(num_used_tokens=3584, token_usage=0.25, num_running_reqs=4, num_queue_reqs=1,
                    num_grammar_queue_reqs=1, cache_hit_rate=0.2, gen_throughput=640.0,
                    num_retracted_reqs=2)  # fmt: skip
    sched.log_stats(num_retracted_reqs=0)  # the next log: none since, and no total kept
    for i in range(5):
        tok.finish(prompt=700, cached=100 * i, generated=60, ttft=0.2, itl=0.02)
    return srv.text()


SERVER_INFO_053 = FIXTURES / "sglang_server_info_0.5.3.json"

RENDERERS = {
    "sglang_metrics_0.5.3.txt": render_053_fixture,
    "sglang_metrics_tp1.txt": render_tp1_fixture,
    "sglang_metrics_dp2_tp4.txt": render_dp2_tp4_fixture,
}


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_fixture_is_what_prometheus_client_renders(name: str, tmp_path: Path) -> None:
    """The checked-in text is the multiprocess rendering (file order aside)."""
    try:
        rendered = RENDERERS[name](tmp_path)
    finally:
        values.close_all_multiprocess_files()
    assert sorted(_fixture(name).splitlines()) == sorted(rendered.splitlines())


def test_fixture_has_sglangs_shape() -> None:
    text = _fixture("sglang_metrics_dp2_tp4.txt")
    assert "# TYPE sglang:token_usage gauge" in text
    assert "# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV" in text
    assert "_created" not in text  # multiprocess mode has none
    usage = [
        s.labels
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "sglang:token_usage"
    ]
    assert len(usage) == 4
    assert {u["tp_rank"] for u in usage} == {"0", "1", "2", "3"}
    assert {u["dp_rank"] for u in usage} == {"0", "1"}
    assert all("pid" not in u for u in usage)  # mostrecent gauges merge processes
    assert 'sglang:num_retracted_reqs{dp_rank="0",engine_type="unified"' in text
    assert ',pid="' in text  # ... the "all" gauge keeps one series per process


def test_parse_single_rank() -> None:
    r = parse_sglang_metrics(_fixture("sglang_metrics_tp1.txt"))
    assert r.source == "sglang"
    assert r.model == MODEL
    assert r.instance_id is None  # SGLang's multiprocess registry has no process metrics
    assert r.occupancy == pytest.approx(0.25)
    assert (r.capacity_blocks, r.used_blocks, r.free_blocks) == (262144, 65536, 196608)
    assert r.block_size == 1  # the default page size
    assert r.cached_blocks is None and r.bytes_per_token is None
    assert r.prefix_cache_enabled is None
    assert (r.running, r.waiting, r.swapped) == (12, 3, None)
    assert r.preemptions_total == 2  # the counter; the gauge has gone back to 0
    assert (r.prefix_queries_tokens_total, r.prefix_hits_tokens_total) == (2000, 600)
    assert r.ttft is not None
    assert r.ttft.bounds == tuple(float(b) for b in TTFT_BUCKETS)
    assert r.ttft.count == 2 and r.ttft.sum == pytest.approx(1.05)
    assert r.ttft.counts[TTFT_BUCKETS.index(0.2)] == 1
    assert r.tpot is not None  # from sglang:inter_token_latency_seconds
    assert r.tpot.count == 2 and r.tpot.sum == pytest.approx(0.042)


@pytest.mark.parametrize(("page_size", "capacity"), [(1, 262144), (16, 16384), (64, 4096)])
def test_blocks_are_tokens_over_page_size(page_size: int, capacity: int) -> None:
    r = parse_sglang_metrics(_fixture("sglang_metrics_tp1.txt"), page_size=page_size)
    assert r.block_size == page_size
    assert r.capacity_blocks == capacity
    assert r.used_blocks == capacity // 4
    assert r.occupancy == pytest.approx(0.25)


def test_page_size_not_dividing_the_pool_rounds_down(server: SglangServer) -> None:
    server.scheduler().log_stats(max_total_num_tokens=1000, token_usage=0.5, num_used_tokens=500)
    r = parse_sglang_metrics(server.text(), page_size=16)
    assert r.capacity_blocks == 62 and r.used_blocks == 31


def test_multi_rank_reads_rank_0_of_each_pool_and_adds_the_pools() -> None:
    r = parse_sglang_metrics(_fixture("sglang_metrics_dp2_tp4.txt"))
    # two pools of 131,072 tokens at 0.5 and 0.25 (tp rank 1's 0.52 is not read)
    assert r.capacity_blocks == 2 * 131072
    assert r.occupancy == pytest.approx(0.375)
    assert r.used_blocks == 65536 + 32768
    # requests: rank 0 of pool 0 plus rank 2 of pool 1, not all four ranks
    assert (r.running, r.waiting) == (10 + 6, 4 + 0)
    # each pool's ranks retract the same requests: 3 + 1, not 3 + 3 + 1 + 1
    assert r.preemptions_total == 4
    assert (r.prefix_queries_tokens_total, r.prefix_hits_tokens_total) == (7000, 4000)
    assert r.ttft is not None and r.ttft.count == 3


def test_pipeline_ranks_share_one_pool(server: SglangServer) -> None:
    """Each pipeline stage's scheduler (tp rank 0 of its stage) reports the same token pool."""
    for pp_rank in (0, 1):
        server.scheduler(pp_rank=pp_rank).log_stats(
            max_total_num_tokens=50000, token_usage=0.4 + 0.01 * pp_rank, num_running_reqs=5
        )
    r = parse_sglang_metrics(server.text())
    assert (r.capacity_blocks, r.running) == (50000, 5)
    assert r.occupancy == pytest.approx(0.4)


def test_rank_order_is_numeric(server: SglangServer) -> None:
    """Of tp ranks 9 and 10 (of one pool), rank 9's series is read: ranks compare as numbers."""
    for tp_rank in (10, 9):
        server.scheduler(tp_rank=tp_rank).log_stats(
            max_total_num_tokens=1000, token_usage=tp_rank / 100, num_retracted_reqs=tp_rank
        )
    r = parse_sglang_metrics(server.text())
    assert r.occupancy == pytest.approx(0.09)
    assert r.preemptions_total == 9


def test_unequal_dp_pools_weight_the_occupancy(server: SglangServer) -> None:
    for dp_rank, tokens, usage in ((0, 30000, 0.5), (1, 10000, 0.1)):
        server.scheduler(tp_rank=dp_rank, dp_rank=dp_rank).log_stats(
            max_total_num_tokens=tokens, token_usage=usage, num_queue_reqs=dp_rank + 1
        )
    r = parse_sglang_metrics(server.text())
    assert r.capacity_blocks == 40000
    assert r.used_blocks == 15000 + 1000
    assert r.occupancy == pytest.approx(16000 / 40000)
    assert r.waiting == 3


def test_pool_size_unknown_for_one_pool_gives_the_plain_mean(server: SglangServer) -> None:
    server.scheduler(dp_rank=0).log_stats(max_total_num_tokens=30000, token_usage=0.5)
    server.scheduler(tp_rank=1, dp_rank=1).log_stats(token_usage=0.1)
    r = parse_sglang_metrics(server.text())
    assert r.capacity_blocks is None and r.used_blocks is None and r.free_blocks is None
    assert r.occupancy == pytest.approx(0.3)


def test_legacy_release() -> None:
    r = parse_sglang_metrics(_fixture("sglang_metrics_legacy.txt"))
    assert r.model == MODEL
    assert r.occupancy == pytest.approx(0.28)
    assert r.capacity_blocks is None and r.used_blocks is None  # no max_total_num_tokens
    assert (r.running, r.waiting) == (162, 2826)
    assert r.preemptions_total is None
    # prompt tokens but no cached-token counter: no prefix figures at all
    assert r.prefix_queries_tokens_total is None and r.prefix_hits_tokens_total is None
    assert r.ttft is not None and r.ttft.count == 11008
    assert r.tpot is not None and r.tpot.count == 7400757  # sglang:time_per_output_token_seconds


def test_sglang_0_5_3_metrics_alone_have_no_pool_size() -> None:
    """The pinned release's /metrics: occupancy and requests, but no block count (no
    `sglang:max_total_num_tokens`) and no retraction total."""
    text = _fixture("sglang_metrics_0.5.3.txt")
    r = parse_sglang_metrics(text, page_size=16)
    assert r.occupancy == pytest.approx(0.25)
    assert r.capacity_blocks is None and r.used_blocks is None and r.free_blocks is None
    assert (r.running, r.waiting) == (4, 1)
    # 0.5.3 has only the per-log gauge sglang:num_retracted_reqs (back to 0 at the next log):
    # preemptions are unknown
    retract = {f.name for f in text_string_to_metric_families(text) if "retract" in f.name}
    assert retract == {"sglang:num_retracted_reqs"}
    assert r.preemptions_total is None
    assert r.requests_departed_total == 5
    assert r.requests_arrived_total == 5 + 4 + 1 + 1  # + the one waiting for its grammar
    assert r.prompt_tokens_arrived_total is None  # counted at the finish: not arrivals
    assert r.kv_block_seconds_total is None


def test_sglang_0_5_3_pool_comes_from_its_server_info() -> None:
    """/get_server_info says the running pool: 14,336 tokens (SGLang profiled less than the
    16,384 `--max-total-tokens` cap), pages of 16: 896 blocks, a quarter used. Its own page
    size wins over the sidecar's flag."""
    info = parse_sglang_server_info(SERVER_INFO_053.read_bytes())
    assert info == SglangServerInfo(pool_tokens=(14336,), page_size=16)
    r = parse_sglang_metrics(_fixture("sglang_metrics_0.5.3.txt"), page_size=1, server_info=info)
    assert r.block_size == 16
    assert (r.capacity_blocks, r.used_blocks, r.free_blocks) == (896, 224, 672)
    assert r.occupancy == pytest.approx(0.25)


def _info(**doc: object) -> bytes:
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("disabled", "enabled"), [(True, False), (False, True), ("no", None)])
def test_a_server_with_its_radix_cache_off_says_so(disabled: object, enabled: bool | None) -> None:
    # Off, hits read 0: without the flag HeadroomPrefixCacheIneffective would fire on a cache
    # that is not there (`engine.prefixCaching: false` runs SGLang with --disable-radix-cache).
    info = parse_sglang_server_info(_info(max_total_num_tokens=14336,
                                          disable_radix_cache=disabled))  # fmt: skip
    assert info.prefix_cache_enabled is enabled
    r = parse_sglang_metrics(_fixture("sglang_metrics_0.5.3.txt"), server_info=info)
    assert r.prefix_cache_enabled is enabled


@pytest.mark.parametrize(
    ("body", "pool", "page"),
    [
        # one internal state per data-parallel rank
        (
            _info(page_size=64, max_total_num_tokens=1000, internal_states=[
                {"memory_usage": {"token_capacity": 1000}},
                {"memory_usage": {"token_capacity": 1200}},
            ]),
            (1000, 1200),
            64,
        ),
        # no internal states: the first rank's pool, once per data-parallel rank
        (_info(max_total_num_tokens=5000, dp_size=2), (5000, 5000), None),
        (_info(max_total_num_tokens=5000, internal_states=[], page_size=1), (5000,), 1),
        # an internal state without a capacity: the top-level figure
        (_info(max_total_num_tokens=700, internal_states=[{"memory_usage": {}}]), (700,), None),
        # internal states of no shape the endpoint documents: the top-level figure too
        (
            _info(max_total_num_tokens=700, internal_states=[{"memory_usage": None}, "x"]),
            (700,),
            None,
        ),
    ],
)  # fmt: skip
def test_server_info_pool_sizes(body: bytes, pool: tuple[int, ...], page: int | None) -> None:
    assert parse_sglang_server_info(body) == SglangServerInfo(pool_tokens=pool, page_size=page)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"<html>404</html>",
        b"[1, 2]",
        b"[" * 100_000,  # nested past the parser's recursion limit (a RecursionError)
        _info(page_size=16),  # no pool size anywhere
        _info(max_total_num_tokens=-5),
        _info(max_total_num_tokens=True),
        _info(max_total_num_tokens="14336"),
        _info(internal_states=[{"memory_usage": {"token_capacity": 0}}]),
    ],
)
def test_server_info_without_a_pool_size_is_garbage(body: bytes) -> None:
    with pytest.raises(GarbageError, match="SGLang server info"):
        parse_sglang_server_info(body)


def test_server_info_pools_pair_with_dp_ranks_in_order(server: SglangServer) -> None:
    for dp_rank, usage in ((1, 0.1), (0, 0.5)):
        server.scheduler(tp_rank=dp_rank, dp_rank=dp_rank, release="0.5.3").log_stats(
            token_usage=usage
        )
    text = server.text()
    # dp rank 0 holds 3000 tokens at 0.5, rank 1 1000 at 0.1
    r = parse_sglang_metrics(text, server_info=SglangServerInfo((3000, 1000), None))
    assert r.capacity_blocks == 4000
    assert r.used_blocks == 1500 + 100
    # a server info with another number of pools is not guessed at
    r = parse_sglang_metrics(text, server_info=SglangServerInfo((3000,), None))
    assert r.capacity_blocks is None and r.occupancy == pytest.approx(0.3)


def test_exported_pool_size_wins_over_server_info() -> None:
    r = parse_sglang_metrics(
        _fixture("sglang_metrics_tp1.txt"), server_info=SglangServerInfo((1000,), None)
    )
    assert r.capacity_blocks == 262144


_USAGE = '# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name="m",tp_rank="0"} 0.5\n'


def test_retracted_reqs_as_gauge_or_counter() -> None:
    gauge = (
        _USAGE + "# TYPE sglang:num_retracted_reqs gauge\n"
        'sglang:num_retracted_reqs{model_name="m",tp_rank="0"} 7.0\n'
    )
    # a gauge of retractions since the last stats log is not a running total: not read
    assert parse_sglang_metrics(gauge).preemptions_total is None
    # 0.5.7's counter, one pool's ranks read once
    counter = (
        _USAGE + "# TYPE sglang:num_retracted_requests_total counter\n"
        'sglang:num_retracted_requests_total{model_name="m",tp_rank="0"} 7.0\n'
        'sglang:num_retracted_requests_total{model_name="m",tp_rank="1"} 7.0\n'
    )
    assert parse_sglang_metrics(counter).preemptions_total == 7
    both = (
        gauge + "# TYPE sglang:num_retracted_requests_total counter\n"
        'sglang:num_retracted_requests_total{model_name="m",tp_rank="0"} 40.0\n'
    )
    assert parse_sglang_metrics(both).preemptions_total == 40
    # names no SGLang release exports are not read
    for name in ("sglang:total_retracted_reqs", "sglang:num_retracted_reqs_total"):
        other = _USAGE + f'{name}{{model_name="m",tp_rank="0"}} 5.0\n'
        assert parse_sglang_metrics(other).preemptions_total is None


def test_without_token_usage_used_over_max_is_read() -> None:
    text = (
        "# TYPE sglang:num_used_tokens gauge\n"
        'sglang:num_used_tokens{tp_rank="0"} 300\n'
        "# TYPE sglang:max_total_num_tokens gauge\n"
        'sglang:max_total_num_tokens{tp_rank="0"} 1200\n'
    )
    r = parse_sglang_metrics(text)
    assert r.occupancy == pytest.approx(0.25)
    assert (r.capacity_blocks, r.used_blocks) == (1200, 300)


@pytest.mark.parametrize("release", ["0.5.3", "later"])
def test_occupancy_is_used_over_the_pool_not_the_rounded_gauge(
    server: SglangServer, release: str
) -> None:
    """SGLang exports `sglang:token_usage` rounded to 2 decimals: 14,300 of 14,336 tokens
    (99.75 %) is 1.0, a full pool and a saturation ETA of 0. `sglang:num_used_tokens` is exact:
    with the pool size known (exported by a later release, from the server info for 0.5.3) the
    occupancy is the exact ratio."""
    stats: dict[str, float] = {"token_usage": round(14300 / 14336, 2), "num_used_tokens": 14300}
    if release != "0.5.3":
        stats["max_total_num_tokens"] = 14336
    server.scheduler(release=release).log_stats(**stats)
    info = SglangServerInfo((14336,), None) if release == "0.5.3" else None
    r = parse_sglang_metrics(server.text(), server_info=info)
    assert r.occupancy == pytest.approx(14300 / 14336) and r.occupancy < 1.0
    assert (r.capacity_blocks, r.used_blocks, r.free_blocks) == (14336, 14300, 36)
    # in pages of 16: 896 blocks, 893.75 of them used
    r = parse_sglang_metrics(server.text(), page_size=16, server_info=info)
    assert (r.capacity_blocks, r.used_blocks, r.free_blocks) == (896, 894, 2)


def test_without_the_pool_size_the_rounded_gauge_is_all_there_is(server: SglangServer) -> None:
    server.scheduler(release="0.5.3").log_stats(
        token_usage=round(14300 / 14336, 2), num_used_tokens=14300
    )
    r = parse_sglang_metrics(server.text())
    assert r.occupancy == 1.0 and r.capacity_blocks is None


def test_a_ratio_the_gauge_disagrees_with_gives_way_to_the_gauge(server: SglangServer) -> None:
    """Where used / pool and the gauge differ by more than the rounding, the ratio is not over
    the pool the server measured (a hybrid model's usage is that of its fuller pool): the
    server's own figure is read."""
    server.scheduler().log_stats(max_total_num_tokens=10000, token_usage=0.9, num_used_tokens=3000)
    r = parse_sglang_metrics(server.text())
    assert r.occupancy == pytest.approx(0.9)
    assert (r.capacity_blocks, r.used_blocks) == (10000, 9000)


@pytest.mark.parametrize(
    ("used", "gauge", "occupancy"),
    [
        (125, 0.13, 0.125),  # half a hundredth off, as the rounding can be: the exact ratio
        (125, 0.12, 0.125),
        (122, 0.13, 0.13),  # further than the rounding: the gauge
        (138, 0.13, 0.13),
    ],
)
def test_the_ratio_is_read_within_the_gauges_rounding_and_no_further(
    used: int, gauge: float, occupancy: float
) -> None:
    """`sglang:token_usage` is rounded to 2 decimals: used / pool is read where it is within
    half a hundredth of the gauge (the edge included), the gauge where it is further."""
    text = (
        f'sglang:token_usage{{tp_rank="0"}} {gauge}\n'
        f'sglang:num_used_tokens{{tp_rank="0"}} {used}\n'
        'sglang:max_total_num_tokens{tp_rank="0"} 1000\n'
    )
    assert parse_sglang_metrics(text).occupancy == pytest.approx(occupancy)


def test_a_pool_read_just_past_full_counts_as_full_beside_another() -> None:
    """Used tokens a little over the pool (the gauge says 1.0) are a full pool: its blocks are
    counted once, not its overshoot, in the occupancy of two data-parallel pools."""
    text = "".join(
        f'sglang:{name}{{dp_rank="{rank}",tp_rank="{rank}"}} {value}\n'
        for rank, gauge, used in ((0, 1.0, 1003), (1, 0.5, 500))
        for name, value in (
            ("token_usage", gauge),
            ("num_used_tokens", used),
            ("max_total_num_tokens", 1000),
        )
    )
    r = parse_sglang_metrics(text)
    assert (r.occupancy, r.capacity_blocks, r.used_blocks) == (0.75, 2000, 1500)


@pytest.mark.parametrize("grammar", ["", 'sglang:num_grammar_queue_reqs{tp_rank="0"} 0\n'])
def test_arrivals_without_requests_in_the_grammar_queue(grammar: str) -> None:
    """An absent or empty grammar queue adds no arrival: departed + running + waiting."""
    text = _USAGE + "sglang:num_requests_total 5\nsglang:num_running_reqs 3\n"
    r = parse_sglang_metrics(text + "sglang:num_queue_reqs 2\n" + grammar)
    assert r.requests_arrived_total == 5 + 3 + 2


def test_instance_id_is_the_process_start_time_where_exported() -> None:
    """A server that exports its process start time is told apart by it across restarts."""
    first = parse_sglang_metrics(_USAGE + "process_start_time_seconds 1700000000.5\n")
    again = parse_sglang_metrics(_USAGE + "process_start_time_seconds 1700000100.25\n")
    assert (first.instance_id, again.instance_id) == ("1700000000.5", "1700000100.25")


def test_prefix_counters_read_no_cached_series_as_no_hits_yet() -> None:
    queries = "sglang:prompt_tokens_total 100\nsglang:num_requests_total 4\n"
    hits = "sglang:cached_tokens_total 40\n"
    r = parse_sglang_metrics(_USAGE + queries + hits)
    assert (r.prefix_queries_tokens_total, r.prefix_hits_tokens_total) == (100, 40)
    # SGLang creates the cached series at the first request with a cached token: a pod whose
    # cache never hit has a 0 % hit ratio, the case its alert is for.
    r = parse_sglang_metrics(_USAGE + queries)
    assert (r.prefix_queries_tokens_total, r.prefix_hits_tokens_total) == (100, 0)
    # The early release counts neither cached tokens nor finished requests: no figures.
    r = parse_sglang_metrics(_USAGE + "sglang:prompt_tokens_total 100\n")
    assert r.prefix_queries_tokens_total is None and r.prefix_hits_tokens_total is None
    r = parse_sglang_metrics(_USAGE + hits)
    assert r.prefix_queries_tokens_total is None and r.prefix_hits_tokens_total is None


def test_usage_above_one_is_clamped() -> None:
    assert parse_sglang_metrics("sglang:token_usage 1.02\n").occupancy == 1.0
    assert parse_sglang_metrics("sglang:token_usage 1.05\n").occupancy == 1.0


def test_used_tokens_over_a_stale_pool_give_way_to_the_gauge() -> None:
    # A server restarted with a bigger pool, read against the dead one's size (or another
    # data-parallel rank's): used / pool is 1.104. The gauge, the server's own, wins; the
    # ratio was refused as garbage before the gauge could, and the engine read as down.
    text = (
        'sglang:token_usage{tp_rank="0"} 0.92\n'
        'sglang:num_used_tokens{tp_rank="0"} 11040\n'
        'sglang:num_running_reqs{tp_rank="0"} 3\n'
        'sglang:num_queue_reqs{tp_rank="0"} 0\n'
    )
    r = parse_sglang_metrics(text, server_info=SglangServerInfo((10000,), 1))
    assert r.occupancy == pytest.approx(0.92)
    # With no gauge, a ratio past any pool's is garbage, not a full pool.
    no_gauge = text.replace(
        'sglang:token_usage{tp_rank="0"} 0.92\n', 'sglang:max_total_num_tokens{tp_rank="0"} 10000\n'
    )
    with pytest.raises(GarbageError, match="not a fraction"):
        parse_sglang_metrics(no_gauge, server_info=SglangServerInfo((10000,), 1))


@pytest.mark.parametrize("usage", ["1.2", "37.5"])
def test_usage_far_above_one_is_garbage_not_a_full_pool(usage: str) -> None:
    # A percent read as a share was a confident full pool, and the operator bought pods.
    with pytest.raises(GarbageError, match="not a fraction"):
        parse_sglang_metrics(f"sglang:token_usage {usage}\n")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "no sglang:token_usage"),
        ("<html><body>404 Not Found</body></html>", "not Prometheus text"),
        ('{"detail": "Not Found"}', "not Prometheus text"),
        # tokenizer metrics only: the schedulers have not logged yet, or another server
        ("sglang:prompt_tokens_total 10\n", "no sglang:token_usage"),
        ('vllm:kv_cache_usage_perc{engine="0"} 0.5\n', "no sglang:token_usage"),
        ("sglang:token_usage NaN\n", "not a fraction"),
        # the gauge is checked even where used / pool is what occupancy is read from
        (
            "sglang:token_usage NaN\nsglang:num_used_tokens 5\nsglang:max_total_num_tokens 10\n",
            "not a fraction",
        ),
        ("sglang:token_usage -0.1\n", "not a fraction"),
        ('sglang:token_usage{tp_rank="0" 0.5\n', "not Prometheus text"),
        (_USAGE + 'sglang:max_total_num_tokens{model_name="m"} -5\n', "max_total_num_tokens"),
        (_USAGE + "sglang:num_running_reqs -1\n", "running"),
        (_USAGE + "sglang:cached_tokens_total +Inf\nsglang:prompt_tokens_total 1\n", "cached"),
        (
            _USAGE + 'sglang:time_to_first_token_seconds_bucket{le="0.1"} 2\n'
            'sglang:time_to_first_token_seconds_bucket{le="+Inf"} 1\n',
            "cumulative",
        ),
        (_USAGE + 'sglang:time_to_first_token_seconds_bucket{le="0.1"} 2\n', r"\+Inf"),
        (
            _USAGE + 'sglang:time_to_first_token_seconds_bucket{le="+Inf"} 1\n'
            "sglang:time_to_first_token_seconds_sum -5\n",
            "sum",
        ),
        (
            _USAGE + 'sglang:time_to_first_token_seconds_bucket{le="+Inf"} 1\n'
            "sglang:time_to_first_token_seconds_sum NaN\n",
            "sum",
        ),
        (_USAGE + 'sglang:token_usage{model_name="m",tp_rank="0"} 0.9\n', "duplicate series"),
    ],
)
def test_garbage_is_rejected(text: str, why: str) -> None:
    with pytest.raises(GarbageError, match=why):
        parse_sglang_metrics(text)
    with pytest.raises(GarbageError, match=why):
        parse_body("sglang", text.encode())


def test_body_that_is_not_utf8_is_garbage() -> None:
    with pytest.raises(GarbageError, match="SGLang /metrics is not UTF-8"):
        parse_body("sglang", b"sglang:token_usage \xff\n")


def _parse_flags(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(flags)


def test_cli_source_sglang_and_page_size() -> None:
    cfg = config_from_args(
        _parse_flags(["--engine-url", "http://127.0.0.1:30000", "--source", "sglang"])
    )
    assert (cfg.source, cfg.page_size) == ("sglang", 1)
    assert cfg.poll_url == "http://127.0.0.1:30000/metrics"
    flags = ["--engine-url", "http://h:30000/", "--source", "sglang", "--page-size", "16"]
    assert config_from_args(_parse_flags(flags)).page_size == 16


def test_page_size_must_be_positive() -> None:
    with pytest.raises(ValidationError, match="page_size"):
        SidecarConfig(engine_url="http://h:1", source="sglang", page_size=0)
    with pytest.raises(ValueError, match="page_size"):
        parse_sglang_metrics(_USAGE, page_size=0)


def test_a_server_whose_cache_never_hit_reads_zero_hits(server: SglangServer) -> None:
    server.scheduler().log_stats(max_total_num_tokens=32000, token_usage=0.5)
    tok = server.tokenizer()
    for _ in range(3):
        tok.finish(prompt=700, cached=0, generated=60, ttft=0.2, itl=0.02)
    text = server.text()
    assert "sglang:prompt_tokens_total" in text and "sglang:cached_tokens_total" not in text
    r = parse_sglang_metrics(text)
    assert (r.prefix_queries_tokens_total, r.prefix_hits_tokens_total) == (2100, 0)
    tok.finish(prompt=700, cached=500, generated=60, ttft=0.2, itl=0.02)
    r = parse_sglang_metrics(server.text())
    assert (r.prefix_queries_tokens_total, r.prefix_hits_tokens_total) == (2800, 500)


async def test_sidecar_in_sglang_mode_exports_headroom_metrics(server: SglangServer) -> None:
    """Sidecar polling a live SGLang-format /metrics (two tp ranks) serves the headroom
    contract, counting each pool once."""
    ranks = [server.scheduler(tp_rank=0), server.scheduler(tp_rank=1)]
    tok = server.tokenizer()
    served = 0

    async def metrics(_: web.Request) -> web.Response:
        nonlocal served
        served += 1
        return web.Response(body=server.text().encode(), content_type="text/plain")

    engine_app = web.Application()
    engine_app.router.add_get("/metrics", metrics)
    async with TestServer(engine_app) as engine:
        cfg = SidecarConfig(
            engine_url=str(engine.make_url("/")),
            source="sglang",
            page_size=16,
            interval=0.1,
            timeout=0.1,
            window=5.0,
            forecast_window=5.0,
        )
        async with TestServer(build_app(cfg)) as sidecar, ClientSession() as http:
            for step in range(12):
                for sched in ranks:
                    sched.log_stats(
                        max_total_num_tokens=32000,
                        token_usage=0.5 + 0.01 * step,
                        num_running_reqs=4,
                        num_retracted_reqs=1 if step == 5 else 0,
                    )
                tok.finish(prompt=100, cached=50, generated=10, ttft=0.2, itl=0.02)
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
    model = (("model", MODEL),)
    assert samples[("headroom_engine_up", model)] == 1.0
    assert samples[("headroom_kv_blocks_capacity", model)] == 2000  # 32,000 tokens / 16
    occupancy = samples[("headroom_kv_block_occupancy_ratio", model)]
    assert 0.5 < occupancy <= 0.62
    used = samples[("headroom_kv_blocks", (*model, ("state", "used")))]
    assert used == round(occupancy * 2000)
    assert ("headroom_kv_blocks", (*model, ("state", "cached"))) not in samples
    assert samples[("headroom_requests", (*model, ("state", "running")))] == 4  # not 8
    assert samples[("headroom_preemptions_total", model)] == 1  # not 2
    assert samples[("headroom_prefix_cache_hit_ratio", model)] == pytest.approx(0.5)
    assert 0 < samples[("headroom_kv_saturation_eta_seconds", model)] < math.inf
    assert report["source"] == "sglang" and report["fresh"] is True
    assert report["capacity_blocks"] == 2000 and report["block_size"] == 16
    assert report["growth_blocks_per_second"] > 0


async def _sidecar_reads(
    routes: dict[str, bytes],
    flags: dict[str, Any],
    done: Callable[[dict[str, Any]], bool] = lambda report: True,
) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], dict[str, Any]]:
    """Start a stand-in serving `routes`, a sidecar polling it; return its samples and report
    once the engine is up, the report fresh and `done` with it (bounded: a server-info request
    a pause timed out is asked again only 10 s later)."""

    def handler(body: bytes) -> Any:
        async def answer(_: web.Request) -> web.Response:
            return web.Response(body=body, content_type="text/plain")

        return answer

    engine_app = web.Application()
    for route, body in routes.items():
        engine_app.router.add_get(route, handler(body))
    async with TestServer(engine_app) as engine:
        cfg = SidecarConfig(engine_url=str(engine.make_url("/")), source="sglang", interval=0.2,
                            timeout=0.2, window=5.0, forecast_window=5.0, **flags)  # fmt: skip
        async with TestServer(build_app(cfg)) as sidecar, ClientSession() as http:
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                text, report = await scrape_when_up(http, sidecar)
                if done(report):
                    break
                assert asyncio.get_running_loop().time() < deadline, report
                await asyncio.sleep(0.05)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    return samples, report


@pytest.mark.parametrize("info_route", ["/get_server_info", "/server_info"])
async def test_sidecar_reports_an_sglang_0_5_3_pool_and_the_plan(info_route: str) -> None:
    """Against the pinned release the sidecar reads the running pool from the server-info
    route (0.5.3's `/get_server_info`, or the later `/server_info`) and exports it beside the
    planned pool: 896 blocks run where 1024 were planned."""
    samples, report = await _sidecar_reads(
        {
            "/metrics": _fixture("sglang_metrics_0.5.3.txt").encode(),
            info_route: SERVER_INFO_053.read_bytes(),
        },
        {"page_size": 1, "planned_blocks": 1024},
        lambda report: report["capacity_blocks"] is not None,
    )
    model = (("model", MODEL),)
    assert report["fresh"] is True
    assert (report["capacity_blocks"], report["used_blocks"], report["block_size"]) == (
        896, 224, 16,
    )  # fmt: skip
    assert samples[("headroom_kv_blocks_capacity", model)] == 896
    assert samples[("headroom_kv_blocks_planned", model)] == 1024
    assert samples[("headroom_kv_blocks", (*model, ("state", "free")))] == 672
    assert ("headroom_preemptions_total", model) not in samples  # 0.5.3 has no total
    assert samples[("headroom_requests_departed_total", model)] == 5
    # 5 departed + 4 running + 1 queued; the one waiting for its grammar is counted once it
    # reaches the queue or finishes (PollState reads arrivals as of the stats log)
    assert samples[("headroom_requests_arrived_total", model)] == 10


async def test_sglang_without_server_info_still_reports_occupancy() -> None:
    """A server that does not answer the server-info routes is up; only its blocks are
    unknown."""
    samples, report = await _sidecar_reads(
        {"/metrics": _fixture("sglang_metrics_0.5.3.txt").encode()}, {"page_size": 16}
    )
    model = (("model", MODEL),)
    assert report["fresh"] is True and report["capacity_blocks"] is None
    assert samples[("headroom_engine_up", model)] == 1.0
    assert samples[("headroom_kv_block_occupancy_ratio", model)] == pytest.approx(0.25)
    assert ("headroom_kv_blocks_capacity", model) not in samples
    assert samples[("headroom_sidecar_poll_errors_total", (*model, ("reason", "http_status")))] == 0


@pytest.mark.parametrize(
    ("served", "asked"),
    [
        # answered: read once, then again only a minute later
        ({"/get_server_info"}, {"/get_server_info": 1}),
        # not served at all: both routes tried once, retried only after 10 s (the six polls
        # take about 3 s)
        (set(), {"/get_server_info": 1, "/server_info": 1}),
    ],
)
async def test_server_info_is_not_asked_at_every_poll(
    served: set[str], asked: dict[str, int]
) -> None:
    hits: dict[str, int] = {}
    metrics = _fixture("sglang_metrics_0.5.3.txt").encode()

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        hits[request.path] = hits.get(request.path, 0) + 1
        response: web.StreamResponse = await handler(request)
        return response

    async def answer(request: web.Request) -> web.Response:
        if request.path == "/metrics":
            return web.Response(body=metrics, content_type="text/plain")
        return web.Response(body=SERVER_INFO_053.read_bytes(), content_type="application/json")

    engine_app = web.Application(middlewares=[count])
    for route in {"/metrics", *served}:
        engine_app.router.add_get(route, answer)
    async with TestServer(engine_app) as engine:
        # Each request given 0.5 s: one that a pause of this process timed out would be a
        # failure the sidecar is right to ask again for.
        cfg = SidecarConfig(engine_url=str(engine.make_url("/")), source="sglang", interval=0.5,
                            timeout=0.5)  # fmt: skip
        async with TestServer(build_app(cfg)):
            for _ in range(6):
                await next_poll(lambda: hits.get("/metrics", 0))
    assert {path: n for path, n in hits.items() if path != "/metrics"} == asked


if __name__ == "__main__":  # regenerate the fixtures: .venv/bin/python tests/test_sidecar_sglang.py
    import tempfile

    for fixture_name, render in RENDERERS.items():
        with tempfile.TemporaryDirectory() as tmp:
            (FIXTURES / fixture_name).write_text(render(Path(tmp)))
            values.close_all_multiprocess_files()
