"""The benchmarks' guards: degenerate flags are refused (exit 2), a verdict that cannot mean
anything at the sizes asked for is informational, an error counts as explained only by its
injected cause, and the sizes a bench derives follow its flags. No timing is asserted."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bench.verdicts import Verdicts, at_least, positive_int


def _exits_2(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def parse_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arguments that parse stop the test instead of starting the bench's real work."""
    parse = argparse.ArgumentParser.parse_args

    def checked(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        args = parse(self, *a, **k)
        raise AssertionError(f"{self.prog}: parsed without an error: {args}")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", checked)


def test_at_least_refuses_smaller_counts_and_non_integers() -> None:
    assert positive_int("3") == 3
    assert at_least(0)("0") == 0
    for bad in ("0", "-2", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)


_AT_LEAST_1 = "must be at least 1, got 0"


@pytest.mark.parametrize(
    ("module", "argv", "reason"),
    [
        ("kv_waste", ["--requests", "0"], _AT_LEAST_1),
        ("cpu_attention", ["--reps", "0"], _AT_LEAST_1),
        ("cpu_attention", ["--threads", "0"], _AT_LEAST_1),
        ("hf_pipeline", ["--rounds", "0"], _AT_LEAST_1),
        ("hf_pipeline", ["--requests", "0"], _AT_LEAST_1),
        ("kv_pool", ["--repeats", "0"], _AT_LEAST_1),
        ("prefix_trace", ["--requests", "0"], _AT_LEAST_1),
        ("kv_quant_quality", ["--decode", "0"], _AT_LEAST_1),
        ("kv_quant_quality", ["--context", "0"], _AT_LEAST_1),
        ("kv_quant_quality", ["--retrieval-contexts", "0"], "'0' must be positive"),
        ("kv_quant_quality", ["--retrieval-contexts", "512,21"], "'21': a needle prompt needs"),
        ("kv_quant_quality", ["--retrieval-contexts", "1k,x"], "'x' is not a number"),
        ("fault_soak", ["--requests", "0"], _AT_LEAST_1),
        ("fault_soak", ["--concurrency", "0"], _AT_LEAST_1),
        ("fault_soak", ["--fault-rate", "-1"], "must be a probability in (0, 1], got -1"),
        ("fault_soak", ["--fault-rate", "0"], "must be a probability in (0, 1], got 0"),
        ("fault_soak", ["--fault-rate", "1.5"], "must be a probability in (0, 1], got 1.5"),
        ("engine_backends", ["--long-batch", "0"], _AT_LEAST_1),
        ("engine_backends", ["--batches", "0"], _AT_LEAST_1),
        ("engine_backends", ["--batches", "1,-8"], "must be at least 1, got -8"),
        ("engine_backends", ["--batches", ","], "needs at least one batch size"),
        ("engine_backends", ["--models", "foo"], "unknown model 'foo' (one of tiny, llama-1b)"),
        ("engine_backends", ["--models", "tiny,foo"], "unknown model 'foo'"),
        ("sidecar", ["--seeds", "0"], _AT_LEAST_1),
        ("sidecar", ["--renders", "0"], _AT_LEAST_1),
        ("sidecar", ["--cpu-seconds", "0"], "must be a positive number of seconds, got 0"),
        ("sidecar", ["--cpu-seconds", "nan"], "must be a positive number of seconds, got nan"),
    ],
)
@pytest.mark.usefixtures("parse_only")
def test_degenerate_arguments_exit_2_with_a_message(
    module: str, argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    bench = importlib.import_module(f"bench.{module}")
    err = _exits_2(bench.main, argv, capsys)
    assert f"argument {argv[0]}: " in err and reason in err, err


def test_kv_quant_quality_shortest_retrieval_context_is_the_needle_checks(
    tmp_path: Any,
) -> None:
    """`MIN_RETRIEVAL_CONTEXT` is the shortest context `needle_prompts` takes with the
    retrieval model's own tokenizer (built here without the model)."""
    from bench import kv_quant_quality as bench
    from headroom.engine.kv_check import check
    from headroom.engine.kv_check import retrieval_model as rm
    from headroom.engine.kv_check.prompts import Haystacks
    from headroom.engine.model.tokenizer import HFTokenizer

    rm.write_tokenizer(tmp_path, rm.TrainConfig())
    tok = HFTokenizer(tmp_path / "tokenizer.json", bos_token_id=rm.BOS)
    hay = Haystacks([list(range(100, 300))], tok.bos_token_id)
    shortest = bench.MIN_RETRIEVAL_CONTEXT
    cfg = check.CheckConfig((shortest,), bench.RETRIEVAL_PROMPTS, bench.RETRIEVAL_DEPTHS)
    trials = check.needle_prompts(tok, hay, shortest, cfg)
    assert len(trials) == bench.RETRIEVAL_PROMPTS * len(bench.RETRIEVAL_DEPTHS)
    assert {len(ids) for ids, _, _ in trials} == {shortest}
    with pytest.raises(check.CheckError, match="too short for the needle"):
        check.needle_prompts(tok, hay, shortest - 1, cfg)
    assert bench.parse_contexts("22, 512,1k") == (shortest, 512, 1024)


# --- fault_soak: an error is explained by its injected cause only -------------------------


def _record(i: int, error: str | None, message: str | None = None) -> Any:
    from headroom.engine.loadgen.client import RequestRecord

    return RequestRecord(
        index=i,
        start=0.0,
        concurrency=1,
        shared_prefix=False,
        ok=error is None,
        error=error,
        error_message=message,
    )


def _engine_message(kind: str) -> str:
    """What the server tells a client whose request a fault of `kind` failed: the message of
    the engine's own `RequestFailed` (sent as a 500 or a stream error event, code
    engine_error)."""
    from bench.fault_soak import fault_exception
    from headroom.engine.errors import RequestFailed

    return str(RequestFailed("cmpl-7", fault_exception(kind)))


def test_fault_soak_explains_only_errors_with_the_injected_signature() -> None:
    from bench.fault_soak import classify

    records = [
        _record(0, None),
        _record(1, "client_disconnect", "hung up after 3 tokens, as asked"),
        _record(2, "http_500_server_error", _engine_message("forward")),
        _record(3, "stream_error", _engine_message("sample")),
        _record(4, "stream_error", _engine_message("decode")),
        # A 500 or a stream error of any other cause is a bug the faults do not explain.
        _record(5, "http_500_server_error", "internal server error"),
        _record(6, "stream_error", "request cmpl-9 failed in the engine: KeyError: 17"),
        _record(7, "http_500", None),
        # The fault's message under another status is not what the server sends for it.
        _record(8, "http_400_invalid_request_error", _engine_message("forward")),
        _record(9, "stream_cut", "the stream ended without [DONE]"),
    ]
    explained, unexplained = classify(records)
    assert explained == Counter(disconnect=1, forward=1, sample=1, decode=1)
    assert unexplained == Counter(
        {
            "http_500_server_error": 1,
            "stream_error": 1,
            "http_500": 1,
            "http_400_invalid_request_error": 1,
            "stream_cut": 1,
        }
    )


def test_fault_soak_bounds_each_kinds_failures_by_its_faults() -> None:
    from bench.fault_soak import over_bound

    injected = Counter(forward=2, sample=1, decode=1)
    # A failed step fails at most the requests in flight; a failed decode only its own.
    assert over_bound(Counter(forward=16, sample=8, decode=1), injected, 8) == []
    assert over_bound(Counter(forward=17, decode=2), injected, 8) == [
        "forward 17 > 2 x 8",
        "decode 2 > 1 x 1",
    ]
    assert over_bound(Counter(sample=1), Counter(), 8) == ["sample 1 > 0 x 8"]


# --- kv_pool: the scheduler's pool and lengths follow --repeats ---------------------------


def test_kv_pool_scheduler_run_is_sized_for_any_number_of_repeats() -> None:
    from bench import kv_pool as bench

    repeats, steps, running = 8, 400, 4
    run, sched = bench.scheduler_steps(repeats, steps, running)
    for _ in range(repeats):
        assert run() == steps
    assert len(sched.running) == running and not sched.waiting
    assert sched.preemptions_total == 0
    assert {len(s.output_token_ids) for s in sched.running} == {1 + repeats * steps}


# --- cpu_attention: the clock counts torch's worker threads when there are some -----------


def test_cpu_attention_clock_is_the_process_with_more_than_one_thread() -> None:
    from bench import cpu_attention as bench

    assert bench.cpu_clock(1) is time.thread_time
    assert bench.cpu_clock(2) is time.process_time
    assert "thread" in bench.clock_name(1) and "process" in bench.clock_name(4)


# --- cpu_attention: the dense baseline is SDPA's grouped form, the same math ----------------


@pytest.mark.parametrize("lens", [[40, 40, 40], [64, 17, 33]])
def test_cpu_attention_grouped_dense_baseline_is_the_gqa_math(lens: list[int]) -> None:
    from bench import cpu_attention as bench

    gen = torch.Generator().manual_seed(3)
    b, h, kv, d, n = len(lens), 8, 2, 16, max(lens)
    q = torch.randn(b, h, d, generator=gen)
    k, v = torch.randn(2, b, kv, n, d, generator=gen)
    valid = torch.arange(n)[None, :] < torch.tensor(lens)[:, None]
    mask = None if len(set(lens)) == 1 else valid[:, None, None, :]
    scale = d**-0.5
    grouped = bench.dense_attention(q, k, v, mask, scale)
    assert torch.allclose(grouped, bench.dense_attention_gqa(q, k, v, mask, scale), atol=1e-6)
    # By hand: query head j reads KV head j // (h // kv), over its own valid positions only.
    kh = k.repeat_interleave(h // kv, dim=1)
    vh = v.repeat_interleave(h // kv, dim=1)
    scores = torch.einsum("bhd,bhnd->bhn", q, kh) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    by_hand = torch.einsum("bhn,bhnd->bhd", scores.softmax(-1), vh)
    assert torch.allclose(grouped, by_hand, atol=1e-5)


# --- cpu_attention: a wrong kernel misses whatever its speed ---------------------------------


def test_cpu_attention_grades_correctness_apart_from_speed() -> None:
    from bench import cpu_attention as bench

    assert bench.grade_row(1.0, 3e-7) == []
    assert bench.grade_row(2.0, 3e-7) == ["slow: ratio 2.00 > 1.5"]
    assert bench.grade_row(0.5, 0.3) == ["wrong output: max|diff| 3.0e-01 > 1e-04"]
    assert len(bench.grade_row(0.5, float("nan"))) == 1
    assert len(bench.grade_row(2.0, 0.3)) == 2


def test_cpu_attention_row_measures_a_wrong_kernels_difference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A paged kernel that attends to the second half of each context only (half the work,
    the wrong output) gives a difference far over the tolerance; the right one does not."""
    from bench import cpu_attention as bench
    from headroom.engine.attention import TorchBackend

    lens = [64, 48, 40]
    _, _, _, right = bench.attention_row(lens, 1, torch.Generator().manual_seed(0))
    assert not bench.grade_row(1.0, right)

    class HalfContext(TorchBackend):
        def decode(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return super().decode(*args, sliding_window=min(lens) // 2)

    monkeypatch.setattr(bench, "TorchBackend", HalfContext)
    _, _, _, wrong = bench.attention_row(lens, 1, torch.Generator().manual_seed(0))
    assert wrong > 100 * bench.DIFF_TOLERANCE
    assert bench.grade_row(0.5, wrong) == [
        f"wrong output: max|diff| {wrong:.1e} > {bench.DIFF_TOLERANCE:.0e}"
    ]


def test_cpu_attention_prints_miss_and_exits_1_for_a_fast_wrong_kernel(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import cpu_attention as bench

    # Every row twice as fast as dense; the mixed row's output is wrong.
    monkeypatch.setattr(
        bench, "attention_row", lambda lens, *a: (0.5, 1.0, 2.0, 0.2 if len(set(lens)) > 1 else 0.0)
    )
    monkeypatch.setattr(bench, "tiny_decode_tokens_per_s", lambda *a: (1.0, 1.0))
    monkeypatch.setattr(bench, "pin_to_one_core", lambda: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    assert bench.main(["--reps", "1"]) == 1
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.strip().startswith(("512", "mixed"))]
    assert rows[0].endswith(" PASS")
    assert "MISS (wrong output: max|diff| 2.0e-01 > 1e-04)" in rows[1]
    assert "4 PASS, 1 MISS" in captured.err


# --- engine_backends: an fp8 target above the bytes ceiling is not graded -----------------


@pytest.mark.parametrize(("ceiling", "graded"), [(1.5, False), (1.8, True)])
def test_fp8_row_is_informational_where_the_ceiling_is_under_the_target(
    ceiling: float,
    graded: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench import engine_backends as bench

    rates = {"auto": 1000.0, "fp8": 1400.0}  # 1.4x: under the 1.7x target
    monkeypatch.setattr(bench, "unavailable", lambda *a: None)
    monkeypatch.setattr(
        bench, "measure", lambda loaded, backend, kv, *a: iter([(1, rates[kv], 1.0)])
    )
    monkeypatch.setattr(
        bench, "step_bytes", lambda loaded, kv, *a: ceiling if kv == "auto" else 1.0
    )
    loaded = SimpleNamespace(name="llama-1b", config=None)
    args = SimpleNamespace(long_batch=64, long_context=2048, new_tokens=128)
    v = Verdicts()
    bench.fp8_row(loaded, torch.device("cpu"), args, v)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    if graded:
        assert len(v.missed) == 1 and not v.informational
        assert "MISS" in out and "not graded" not in out
    else:
        assert not v.missed and len(v.informational) == 1
        assert "MISS (informational)" in out and "not graded" in out


# --- hf_pipeline: headroom's useful slots count its recompute after preemptions -----------


def test_hf_pipeline_counts_the_positions_headroom_computes_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench import hf_pipeline as bench
    from headroom.engine.config import EngineConfig
    from headroom.engine.engine import Engine

    monkeypatch.setattr(bench, "MAX_PROMPT", 80)
    monkeypatch.setattr(bench, "MAX_OUTPUT", 40)
    reqs = bench.workload(6, seed=1)
    useful = sum(len(r.prompt) + r.output for r in reqs)
    got = {}
    for blocks in (64, 10):  # room for all six; then for one or two at a time
        engine = Engine.from_config(
            EngineConfig(model="tiny", num_blocks=blocks, max_model_len=120, num_threads=1)
        )
        run = bench.run_headroom(engine, reqs)
        got[blocks] = (engine.scheduler.preemptions_total, run)
        assert run.useful_slots == useful
    (p_big, big), (p_small, small) = got[64], got[10]
    assert p_big == 0 and big.slots == useful
    assert p_small > 0 and small.slots > useful  # recompute is not useful
    # The counter is taken off again: the engine schedules as before.
    assert "schedule" not in vars(engine.scheduler)


# --- prefix_trace: no sharing, nothing to grade ------------------------------------------


def test_prefix_trace_with_no_shared_prefix_grades_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import prefix_trace as bench

    if not bench.TRACE.is_file():
        pytest.skip(f"the trace {bench.TRACE} is missing")
    # Caching slower than off: a MISS, were either target graded.
    replays = iter([bench.Replay([0.2], 0.0, 1.0, 1.0), bench.Replay([0.1], 0.0, 1.0, 1.0)] * 2)
    monkeypatch.setattr(bench, "replay", lambda *a, **k: next(replays))
    monkeypatch.setattr(sys, "argv", ["prefix_trace", "--requests", "1"])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "not graded, no sharing in these requests" in out
    assert "0 PASS, 0 MISS, 2 informational" in out


# --- kv_quant_quality: the auto row needs a context it was trained at ---------------------


def test_retrieval_auto_row_is_informational_without_a_short_context() -> None:
    from bench import kv_quant_quality as bench

    rows = [
        bench.RetrievalRow("auto (fp32 KV)", None, None, True),
        bench.RetrievalRow("int8", None, None, True),
    ]
    v = Verdicts()
    lines = bench.retrieval_rows(rows, (2048,), {"auto (fp32 KV)": [0.4], "int8": [0.4]}, v)
    assert not v.missed and v.informational == ["retrieval: auto (fp32 KV)"]
    assert "not graded: no context <= 1k given" in lines[0]
    assert v.passed == 1  # int8 is still graded against auto
    v = Verdicts()
    bench.retrieval_rows(rows, (512, 2048), {"auto (fp32 KV)": [0.4, 0.4], "int8": [0.4] * 2}, v)
    assert v.missed == ["retrieval: auto (fp32 KV)"]


# --- autoscale_sim: --only names a trace ----------------------------------------------------


def test_autoscale_only_refuses_unknown_traces(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import autoscale_sim as bench

    err = _exits_2(bench.main, ["--only", "spike", "no-such-trace"], capsys)
    assert "no trace named no-such-trace" in err and "spike, diurnal" in err
