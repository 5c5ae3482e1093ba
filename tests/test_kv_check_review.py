"""`headroom kv-check` and the fp8 KV scales, as a review found them: the check runs fp8 with
the scales file `headroom serve` applies, --calibrate writes its file only after the check has
run, verdicts exactly at a threshold do not hang on float rounding, `--scales-out -` is
refused, scales stay normal fp32 numbers, and the CUDA int8 write keeps NaN as torch does.
A mutation-testing round added pins of what no test noticed: the scoring of `run_check` (on a
stand-in session), the needle's room, the option checks, progress, calibration's window, and
the retrieval model's vocabulary, filler, training sequences and cache.

The command tests use a two-step, untrained build of the retrieval model (as test_kv_check.py).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from headroom.contract.cli import main as headroom
from headroom.engine.attention import TorchBackend, allocate_layer_cache
from headroom.engine.attention import cuda_backend as cb
from headroom.engine.attention.kv_scales import (
    SCALE_MAX,
    SCALE_MIN,
    SCALES_FILE,
    KVScales,
    KVScalesError,
    apply_scales,
    read_scales,
    write_scales,
)
from headroom.engine.kernels import compile as kc
from headroom.engine.kv_check import check, metrics, needle
from headroom.engine.kv_check import cli as kv_cli
from headroom.engine.kv_check import retrieval_model as rm
from headroom.engine.kv_check.calibrate import scales_from_absmax
from headroom.engine.kv_check.session import KVSetting
from headroom.engine.model import load_model

QUICK = rm.TrainConfig(steps=2, batch=2, min_len=48, max_len=48)
# The smallest run of the command: one prompt, one needle, a few positions.
SMALL = ("--num-prompts", "1", "--depths", "0.5", "--positions", "4", "--greedy-tokens", "4")
# The tiny model's byte tokenizer: the needle's fact and question are 90-odd tokens.
_TOK = load_model("tiny").tokenizer


@pytest.fixture(scope="module")
def untrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rm.train(QUICK, tmp_path_factory.mktemp("untrained") / "model")


@pytest.fixture
def model(untrained: Path, tmp_path: Path) -> Path:
    """A private copy of the model directory (the tests put scales files in it)."""
    return Path(shutil.copytree(untrained, tmp_path / "model"))


def _args(model: Path, *extra: str) -> list[str]:
    return ["kv-check", "--model", str(model), "--prompts", str(model / "documents.jsonl"),
            "--kv-cache-dtype", "fp8", *extra]  # fmt: skip


def _scales(value: float, layers: int = 2, heads: int = 2) -> KVScales:
    return KVScales(k_scale=[[value] * heads] * layers, v_scale=[[value] * heads] * layers,
                    source="test")  # fmt: skip


def _spy_run_check(monkeypatch: pytest.MonkeyPatch) -> list[list[KVSetting]]:
    """Record the settings each run_check is given, then run the real check."""
    seen: list[list[KVSetting]] = []
    real = check.run_check

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(list(args[4]))
        return real(*args, **kwargs)

    monkeypatch.setattr(check, "run_check", spy)
    return seen


def _no_check(monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError(f"the check ran {what}")

    monkeypatch.setattr(check, "run_check", refuse)


# -- 1. without --calibrate, fp8 is checked with the scales the engine applies ----------------


def test_fp8_is_checked_with_the_model_directorys_scales_file(
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stale = _scales(1e-4)  # saturates nearly every |K| and |V|: what serve would run
    write_scales(stale, model / SCALES_FILE)
    seen = _spy_run_check(monkeypatch)
    out_json = tmp_path / "r.json"
    rc = headroom(_args(model, "--contexts", "96", *SMALL, "--json", str(out_json), "--quiet"))
    out = capsys.readouterr().out
    assert rc in (0, 1)
    (settings,) = seen
    assert [s.name for s in settings] == ["auto", f"fp8 ({SCALES_FILE})"]
    assert settings[-1].kv_dtype == "fp8"
    assert settings[-1].scales == read_scales(model / SCALES_FILE) == stale
    report = json.loads(out_json.read_text())
    labels = [s["setting"] for s in report["contexts"][0]["settings"]]
    assert labels == ["auto", "fp8 (kv_cache_scales.json)"]
    assert report["verdicts"][0].startswith("fp8 (kv_cache_scales.json) ")
    # The row is labelled in full in the table (the KV column widens for it).
    assert "     96 fp8 (kv_cache_scales.json)" in out


def test_without_a_scales_file_fp8_is_checked_at_scale_one(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _spy_run_check(monkeypatch)
    assert headroom(_args(model, "--contexts", "96", *SMALL, "--quiet")) in (0, 1)
    assert [(s.name, s.scales) for s in seen[0]] == [("auto", None), ("fp8", None)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"k_scale": [[1.0]], "v_scale": [[0.0]]}', "cannot read KV scales from"),
        ("not json", "cannot read KV scales from"),
        (_scales(0.5, layers=3).model_dump_json(), "KV scales have 3 layers, the model has 2"),
        (_scales(0.5, heads=4).model_dump_json(), "k_scale[0] has 4 heads, the model has 2"),
    ],
    ids=["zero", "garbage", "layers", "heads"],
)
def test_a_scales_file_the_engine_would_refuse_exits_2_before_the_check(
    model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: str,
    message: str,
) -> None:
    (model / SCALES_FILE).write_text(content)
    _no_check(monkeypatch, "with a scales file the engine refuses")
    assert headroom(_args(model, "--contexts", "96", *SMALL, "--quiet")) == 2
    err = capsys.readouterr().err
    assert message in err and str(model / SCALES_FILE) in err, err


def test_calibrate_says_it_replaces_an_existing_scales_file(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_scales(_scales(1e-4), model / SCALES_FILE)
    _no_check(monkeypatch, "in a test of the notes before it")
    with pytest.raises(AssertionError, match="the check ran"):
        headroom(_args(model, "--calibrate", "--contexts", "96", *SMALL, "--quiet"))
    err = capsys.readouterr().err
    assert f"--calibrate replaces the existing {model / SCALES_FILE}" in err


def test_calibrate_elsewhere_says_the_model_directorys_file_stays_in_use(
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    write_scales(_scales(1e-4), model / SCALES_FILE)
    _no_check(monkeypatch, "in a test of the notes before it")
    elsewhere = tmp_path / "kvs.json"
    with pytest.raises(AssertionError, match="the check ran"):
        headroom(_args(model, "--calibrate", "--scales-out", str(elsewhere), "--contexts", "96",
                       *SMALL, "--quiet"))  # fmt: skip
    err = capsys.readouterr().err
    assert f"{model / SCALES_FILE} stays, and headroom serve applies it" in err
    assert "replaces" not in err


# -- 2. --calibrate writes its scales only after the check ran -------------------------------


def test_a_context_too_short_for_the_needle_exits_2_before_calibrating(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = headroom(_args(model, "--calibrate", "--contexts", "12,96", *SMALL))
    err = capsys.readouterr().err
    assert rc == 2
    assert "context 12 is too short for the needle" in err
    assert "calibrating" not in err
    assert not (model / SCALES_FILE).exists()


def test_an_interrupted_calibrate_run_leaves_the_old_scales_file(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _scales(0.25)
    write_scales(old, model / SCALES_FILE)

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(check, "run_check", interrupted)
    with pytest.raises(KeyboardInterrupt):
        headroom(_args(model, "--calibrate", "--contexts", "96", *SMALL, "--quiet"))
    assert read_scales(model / SCALES_FILE) == old
    assert sorted(p.name for p in model.iterdir() if "scales" in p.name) == [SCALES_FILE]


def test_calibrate_writes_the_scales_it_checked_once_the_check_ran(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _spy_run_check(monkeypatch)
    written: list[bool] = []
    real = check.run_check

    def spy(*args: Any, **kwargs: Any) -> Any:
        written.append((model / SCALES_FILE).exists())
        return real(*args, **kwargs)

    monkeypatch.setattr(check, "run_check", spy)
    assert headroom(_args(model, "--calibrate", "--contexts", "96", *SMALL, "--quiet")) in (0, 1)
    assert written == [False]
    (settings,) = seen
    assert [s.name for s in settings] == ["auto", "fp8 (scale 1.0)", "fp8 calibrated"]
    assert read_scales(model / SCALES_FILE) == settings[-1].scales


def test_the_needle_fit_is_checked_at_every_context_before_the_check() -> None:
    from headroom.engine.kv_check.prompts import Haystacks
    from headroom.engine.model import load_model

    tok = load_model("tiny").tokenizer  # bytes: 93 tokens of fact and question
    hay = Haystacks([list(range(10, 400))], tok.bos_token_id)
    check.check_needles_fit(tok, hay, check.CheckConfig(contexts=(128, 256), num_prompts=2))
    with pytest.raises(check.CheckError, match="context 64 is too short"):
        check.check_needles_fit(tok, hay, check.CheckConfig(contexts=(256, 64), num_prompts=2))


def test_room_for_one_haystack_token_is_enough_and_none_is_too_short() -> None:
    """A needle prompt is `<s>`, at least one haystack token, the fact and the question."""
    from headroom.engine.kv_check.prompts import Haystacks

    hay = Haystacks([list(range(10, 400))], _TOK.bos_token_id)

    def cfg(context: int) -> check.CheckConfig:
        return check.CheckConfig(contexts=(context,), num_prompts=1, depths=(0.5,))

    # The needles drawn at 94 and at 95 (seeded by the context) both take 93 bytes.
    with pytest.raises(check.CheckError, match=r"context 94 is too short .*\(93 tokens of fact"):
        check.check_needles_fit(_TOK, hay, cfg(94))
    check.check_needles_fit(_TOK, hay, cfg(95))
    ((ids, nd, _),) = check.needle_prompts(_TOK, hay, 95, cfg(95))
    assert len(ids) == 95 and ids[0] == _TOK.bos_token_id
    assert 10 <= ids[1] < 400 and _TOK.decode(ids[2:]).lstrip().startswith(nd.fact)  # one hay token


# -- 3. verdicts exactly at a threshold ------------------------------------------------------


def _row(name: str, top1: float, needle: float, trials: int = 20) -> check.SettingResult:
    return check.SettingResult(
        setting=name, kv_dtype="fp8", top1_agreement=top1, kl_divergence=0.0,
        greedy_match_tokens=1.0, greedy_full_match=1.0, needle_score=needle, needle_trials=trials,
    )  # fmt: skip


def _results(ref_needle: float, needle: float, top1: float) -> list[check.ContextResult]:
    rows = [_row("auto", 1.0, ref_needle), _row("fp8", top1, needle)]
    return [check.ContextResult(context=1024, settings=rows)]


def _top1_of(agree: int, positions: int = 20) -> float:
    ref = torch.zeros(positions, 5)
    ref[:, 0] = 1
    other = ref.clone()
    other[agree:, 0], other[agree:, 1] = 0, 1
    return metrics.top1_agreement(ref, other)


def test_exactly_90_percent_top1_is_safe_and_less_is_not() -> None:
    assert _top1_of(18) == 0.9  # float32's mean made it 0.89999998
    at = metrics.mean([_top1_of(18)] * 4)
    assert check.all_safe(_results(1.0, 1.0, at), "fp8")
    assert check.all_safe(_results(1.0, 1.0, metrics.mean([0.85, 0.95])), "fp8")
    below = metrics.mean([_top1_of(17)] * 4)
    assert not check.all_safe(_results(1.0, 1.0, below), "fp8")
    assert check.verdict(_results(1.0, 1.0, below), "fp8").endswith(
        "top-1 agreement is 85% (< 90%)"
    )
    almost = _results(1.0, 1.0, metrics.mean([_top1_of(18), _top1_of(18), _top1_of(17)]))
    assert check.verdict(almost, "fp8").endswith("top-1 agreement is 88.3% (< 90%)")
    # Just under the threshold does not print as the threshold ("90% (< 90%)").
    assert check.verdict(_results(1.0, 1.0, 0.8996), "fp8").endswith("is 89.9% (< 90%)")


@pytest.mark.parametrize("found", [20, 16, 8, 4, 1])
def test_losing_one_needle_of_20_is_safe_whatever_the_reference_found(found: int) -> None:
    def score(k: int) -> float:
        return metrics.mean([1.0] * k + [0.0] * (20 - k))

    assert check.all_safe(_results(score(found), score(found - 1), 1.0), "fp8")
    if found >= 2:  # two needles (0.10) lost is not within 0.05
        assert not check.all_safe(_results(score(found), score(found - 2), 1.0), "fp8")
        assert "the needle score drops" in check.verdict(
            _results(score(found), score(found - 2), 1.0), "fp8"
        )


def test_an_agreement_with_one_decimal_prints_exactly_that_decimal() -> None:
    """177 of 200 is 88.5%: rounding down past the threshold must not make it 88.4%."""
    assert check.verdict(_results(1.0, 1.0, _top1_of(177, 200)), "fp8").endswith(
        "top-1 agreement is 88.5% (< 90%)"
    )


def test_a_verdict_safe_everywhere_names_the_longest_context_and_its_scores() -> None:
    """The contexts are sorted: "up to" is the longest checked, with the scores found there."""
    results = [
        check.ContextResult(context=c, settings=[_row("auto", 1.0, a), _row("fp8", t, q)])
        for c, a, q, t in ((4096, 0.95, 0.95, 0.97), (1024, 1.0, 1.0, 0.99))
    ]  # fmt: skip
    assert check.verdict(results, "fp8") == (
        "fp8 safe at every context checked (up to 4k): needle score 0.95 vs 0.95 with the auto "
        "cache, top-1 agreement 97%"
    )


def test_a_caveat_is_given_only_below_a_reference_needle_score_of_one_half() -> None:
    """The auto cache finding half the needles still counts as retrieving; less does not."""
    assert check.caveats(_results(0.5, 0.5, 1.0)) == []
    assert check.caveats(_results(0.95, 0.95, 1.0)) == []
    (caveat,) = check.caveats(_results(0.45, 0.45, 1.0))
    assert caveat.startswith("at 1k the model retrieves poorly even with the auto cache (needle")
    assert "(needle 0.45)" in caveat


def test_the_check_config_defaults_are_the_commands() -> None:
    """bench/kv_quant_quality.py relies on the defaults: they measure what kv-check does."""
    parser = argparse.ArgumentParser()
    kv_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["kv-check", "--model", "m", "--prompts", "p", "--kv-cache-dtype",
                              "fp8"])  # fmt: skip
    cfg = check.CheckConfig(contexts=(1024,))
    assert (cfg.num_prompts, cfg.positions, cfg.greedy_tokens, cfg.seed) == (
        args.num_prompts, args.positions, args.greedy_tokens, args.seed)  # fmt: skip
    assert cfg.depths == kv_cli.parse_depths(args.depths)


class _DigitTokenizer:
    """One token per digit of 9s and one per other number: values differ in length."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [9] * text.count("9") or [1]


def test_the_longest_needle_answer_is_the_longest_value_plus_two() -> None:
    """What a needle generates past its context: the longest value's tokens and two more."""
    tok: Any = _DigitTokenizer()
    assert check.needle_tokens(tok, "472") == 3
    assert check.longest_needle_tokens(tok) == 5  # "999"


class _FakeSession:
    """Stands in for `Session`: the "auto" and "same" settings answer alike; "off" has one
    top-1 position of 4 wrong, diverges in greedy at token 2 of its second prompt and gives
    the first needle of each run a wrong value."""

    runs: ClassVar[list[tuple[str, int, int]]] = []  # (what, prompt tokens, tokens generated)

    def __init__(self, model: object, backend: object, setting: KVSetting, device: object) -> None:
        self.off = setting.name == "off"
        self.greedy_calls = self.needle_calls = 0

    def next_token_logits(self, tokens: list[int], context: int) -> torch.Tensor:
        assert len(tokens) == context + 4 and tokens[0] == _TOK.bos_token_id
        logits = torch.eye(8)[:4] * 5
        if self.off:
            logits[0] = torch.eye(8)[7] * 5
        return logits

    def greedy(self, tokens: list[int], n: int) -> list[int]:
        text = _TOK.decode(tokens)
        self.runs.append(("needle" if "pass key" in text else "greedy", len(tokens), n))
        if "pass key" not in text:
            self.greedy_calls += 1
            return [1, 9, 3] if self.off and self.greedy_calls == 2 else [1, 2, 3]
        self.needle_calls += 1
        match = re.search(r"pass key for (\w+) is (\d+)\.", text)
        assert match is not None
        value = "999" if self.off and self.needle_calls == 1 else match[2]
        return _TOK.encode(" " + value + ".", add_special_tokens=False)[:n]


def test_run_check_scores_every_setting_against_the_first_at_each_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompts fill the context exactly, each metric is a mean over prompts against the first
    setting, and progress counts every model run up to the announced total."""
    from headroom.engine.kv_check.prompts import Haystacks

    monkeypatch.setattr(check, "Session", _FakeSession)
    monkeypatch.setattr(_FakeSession, "runs", [])
    hay = Haystacks([_TOK.encode("lorem ipsum dolor sit amet " * 80, add_special_tokens=False)],
                    _TOK.bos_token_id)  # fmt: skip
    cfg = check.CheckConfig(contexts=(160, 192), num_prompts=2, depths=(0.1, 0.9), positions=4,
                            greedy_tokens=3)  # fmt: skip
    settings = [KVSetting("auto", "auto"), KVSetting("same", "fp8"), KVSetting("off", "fp8")]
    seen: list[tuple[int, int, str]] = []
    model: Any = None

    def progress(done: int, total: int, label: str) -> None:
        seen.append((done, total, label))

    results = check.run_check(model, _TOK, model, torch.device("cpu"), settings, hay, cfg, progress)
    assert [r.context for r in results] == [160, 192]
    for r in results:
        for name in ("auto", "same"):
            row = r.of(name)
            assert (row.top1_agreement, row.kl_divergence, row.greedy_match_tokens) == (1, 0, 3)
            assert (row.greedy_full_match, row.needle_score, row.needle_trials) == (1, 1, 4)
        off = r.of("off")
        assert (off.top1_agreement, off.greedy_match_tokens, off.needle_score) == (0.75, 2, 0.75)
        assert (off.greedy_full_match, off.needle_trials, off.kv_dtype) == (0.5, 4, "fp8")
        assert off.kl_divergence > 0
    total = 2 * (2 + 2) * 3 * 2  # prompts x (logits, greedy, needles) x settings x contexts
    assert [(d, t) for d, t, _ in seen] == [(i, total) for i in range(1, total + 1)]
    assert seen[0][2] == "context 160, auto" and seen[-1][2] == "context 192, off"
    per_context = 3 * 2 * (1 + 2)  # settings x prompts x (greedy, needles)
    for i, (what, tokens, n) in enumerate(_FakeSession.runs):
        context = 160 if i < per_context else 192
        assert tokens == context and n == (3 if what == "greedy" else 6)  # bytes of " 123", 2


# -- 4. --scales-out - -------------------------------------------------------------------------


def test_scales_out_dash_is_refused_before_any_work(
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    rc = headroom(_args(model, "--calibrate", "--scales-out", "-", "--contexts", "96", *SMALL))
    err = capsys.readouterr().err
    assert rc == 2
    assert "--scales-out -: the scales go to a file, not stdout" in err
    assert f"MODEL/{SCALES_FILE}" in err and "loading" not in err
    assert list(work.iterdir()) == [] and not (model / SCALES_FILE).exists()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stream", "gap"), [(io.StringIO(), 5.0), (_Tty(), 0.2)])
def test_progress_is_throttled_but_the_last_step_always_shows(
    stream: io.StringIO, gap: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line every 5 s to a file (redrawn every 0.2 s on a terminal, which gets the newline
    only at the end), and done == total whenever it comes."""
    clock = [100.0]
    monkeypatch.setattr(kv_cli.time, "monotonic", lambda: clock[0])
    progress = kv_cli.Progress(stream, enabled=True)
    for t, done in ((100.0, 1), (100.0 + gap * 0.9, 2), (100.0 + gap, 3), (100.0 + gap, 10)):
        clock[0] = t
        progress(done, 10, "step")
    shown = [f"[{d}/10] step ({s:.0f}s)" for d, s in ((1, 0), (3, gap), (10, gap))]
    if isinstance(stream, _Tty):
        assert stream.getvalue() == "".join("\r" + line.ljust(79) for line in shown) + "\n"
    else:
        assert stream.getvalue() == "".join(line + "\n" for line in shown)
    quiet = io.StringIO()
    kv_cli.Progress(quiet, enabled=False)(10, 10, "step")
    kv_cli.Progress(quiet, enabled=False).say("loading")
    assert quiet.getvalue() == ""


def test_device_context_depth_and_thread_options_are_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--device is cpu, cuda[:N] or auto (cuda only with a GPU); a context of one token is
    positive; depths are within [0, 1] ends included; --threads is at least 1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kv_cli._device("auto") == kv_cli._device("cpu") == torch.device("cpu")
    for name, message in (("cuda:0", "torch sees no CUDA GPU"), ("meta", "must be cpu, cuda"),
                          ("gpu", "--device 'gpu'")):  # fmt: skip
        with pytest.raises(kv_cli.UsageError, match=message):
            kv_cli._device(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kv_cli._device("auto") == torch.device("cuda")
    assert kv_cli.parse_contexts("2k,1") == (1, 2048)
    assert kv_cli.parse_depths("0,0.5,1") == (0.0, 0.5, 1.0)
    for bad in ("-0.1", "1.01", "0.5,x"):
        with pytest.raises(kv_cli.UsageError, match="between 0 and 1"):
            kv_cli.parse_depths(bad)
    args = ["kv-check", "--model", "tiny", "--prompts", str(tmp_path / "none.jsonl"),
            "--kv-cache-dtype", "int8", "--threads"]  # fmt: skip
    assert headroom([*args, "0"]) == 2
    assert "--threads must be at least 1" in capsys.readouterr().err
    threads = torch.get_num_threads()
    try:
        assert headroom([*args, "1"]) == 2  # accepted: it fails on the missing prompts
    finally:
        torch.set_num_threads(threads)
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("missing", ["--model", "--prompts", "--kv-cache-dtype"])
def test_each_required_option_is_asked_for_by_name(
    missing: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --model, --prompts or --kv-cache-dtype the parser exits 2 naming it."""
    given = {"--model": "tiny", "--prompts": "docs.jsonl", "--kv-cache-dtype": "fp8"}
    del given[missing]
    with pytest.raises(SystemExit) as exc:
        headroom(["kv-check", *(x for kv in given.items() for x in kv)])
    assert exc.value.code == 2
    assert f"required: {missing}" in capsys.readouterr().err


def test_a_report_file_that_cannot_be_written_is_a_usage_error(tmp_path: Path) -> None:
    """--json or --plot failing late still exits 2 with the path (stdout's own error aside)."""
    with pytest.raises(kv_cli.UsageError, match=f"cannot write {tmp_path}"):
        kv_cli._write(tmp_path, "{}")  # a directory


def test_calibration_prefills_the_longest_context_but_at_most_8192_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each prompt's window, `<s>` included, is the longest context up to CALIBRATION_TOKENS."""
    from headroom.engine.kv_check.prompts import Haystacks

    seen: list[tuple[list[list[int]], str]] = []
    monkeypatch.setattr(kv_cli, "calibrate", lambda *a, source, **_: seen.append((a[3], source)))
    args = argparse.Namespace(prompts=Path("docs.jsonl"))
    loaded: Any = argparse.Namespace(model=None)
    quiet = kv_cli.Progress(io.StringIO(), enabled=False)
    for bos, contexts, n in ((0, (1024, 16384), 8191), (0, (512, 1024), 1023), (None, (512,), 512)):
        hay = Haystacks([list(range(10, 400))], bos)
        cfg = check.CheckConfig(contexts=contexts, num_prompts=2)
        kv_cli._calibrate(args, loaded, None, torch.device("cpu"), hay, cfg, quiet)
        prompts, source = seen.pop()
        assert [len(p) for p in prompts] == [n + (bos is not None)] * 2
        assert source == f"docs.jsonl: 2 prompts of {n} tokens"
        assert prompts[0][0] == (10 if bos is None else bos) and prompts[0] != prompts[1]


# -- 5. scales are normal fp32 numbers -------------------------------------------------------


@pytest.mark.parametrize("bad", [1e-46, 1e39, float("nan"), 0.0, -1.0])
def test_a_scale_that_is_not_positive_finite_as_fp32_is_refused(bad: float, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"k_scale\[0\] must be positive finite .* not 0 once"):
        KVScales(k_scale=[[1.0, bad]], v_scale=[[1.0, 1.0]])
    path = tmp_path / SCALES_FILE
    path.write_text(json.dumps({"k_scale": [[1.0]], "v_scale": [[bad]]}))
    with pytest.raises(KVScalesError, match=r"v_scale\[0\] must be positive finite"):
        read_scales(path)


def test_a_subnormal_scale_an_older_calibration_wrote_still_serves(tmp_path: Path) -> None:
    # Calibration before the clamp wrote absmax * margin / 448 for a near-dead head: 1e-39 is
    # a subnormal fp32, usable, and `headroom serve` took it: it must still start.
    path = tmp_path / SCALES_FILE
    path.write_text(json.dumps({"k_scale": [[1e-39, 0.5]], "v_scale": [[1.0, 1.0]]}))
    cache = allocate_layer_cache(1, 16, 2, 4, torch.float32, "fp8")
    apply_scales([cache], read_scales(path))
    kv = torch.tensor([[[1e-37, 0.0, 0.0, 0.0], [1.0, -2.0, 3.0, 0.5]]])
    TorchBackend().write_kv(kv, kv, cache, torch.tensor([0]))
    assert all(torch.isfinite(t).all() for t in cache.dequantized())


def test_the_fp32_range_ends_are_accepted_and_read_back_finite() -> None:
    scales = KVScales(k_scale=[[SCALE_MIN]], v_scale=[[SCALE_MAX]])
    cache = allocate_layer_cache(1, 16, 1, 4, torch.float32, "fp8")
    apply_scales([cache], scales)
    assert cache.k_scale is not None and cache.k_scale.item() == SCALE_MIN
    kv = torch.tensor([[[0.0, 1.0, -2.0, 3.0]]])
    TorchBackend().write_kv(kv, kv, cache, torch.tensor([0]))
    k, v = cache.dequantized()
    assert torch.isfinite(k).all() and torch.isfinite(v).all()


@pytest.mark.parametrize("absmax", [1e-44, 1e-39, 1e40, float("inf")])
def test_calibrated_scales_stay_within_normal_fp32(absmax: float) -> None:
    scales = scales_from_absmax([[absmax, 1.0]], [[1.0, absmax]], "test")
    for s in (*scales.k_scale[0], *scales.v_scale[0]):
        f32 = torch.tensor(s, dtype=torch.float32)
        assert torch.isfinite(f32) and f32.item() >= SCALE_MIN, (absmax, s)
    # And the engine takes them: a near-dead head's keys read back 0, not NaN.
    cache = allocate_layer_cache(1, 16, 2, 4, torch.float32, "fp8")
    apply_scales([cache], scales)
    kv = torch.full((1, 2, 4), absmax if absmax < 1 else 1.0)
    TorchBackend().write_kv(kv, kv, cache, torch.tensor([0]))
    assert all(torch.isfinite(t).all() for t in cache.dequantized())


# -- 6. the retrieval model's task, as its docstring describes it -----------------------------


def _words(lang: rm.Language, ids: list[int]) -> list[str]:
    return [lang.words[i] for i in ids]


def test_the_vocabulary_is_specials_then_one_word_a_token_with_key_is_merged() -> None:
    """Ids 0-3 are the specials the engine is told about, and "KEY is" is one token."""
    cfg = rm.TrainConfig()
    words = rm.vocabulary(cfg)
    assert words[: len(rm.SPECIALS)] == list(rm.SPECIALS)
    assert (words[rm.PAD], words[rm.UNK], words[rm.BOS], words[rm.EOS]) == rm.SPECIALS
    filler = rm.filler_words(cfg.filler_words)
    assert len(filler) == cfg.filler_words == len(set(filler))
    assert all(len(w) == 4 and w[1] in "aeiou" and w[3] in "aeiou" for w in filler)
    assert words[-cfg.filler_words :] == filler
    lang = rm.Language(cfg)
    key = lang.keys[3]
    fact = _words(lang, lang.fact(key, lang.values[0]))
    assert " ".join(fact) == needle.NEEDLE.format(key=needle.KEYS[3], value="100 .").lower()[:-1]
    ask = " ".join(_words(lang, lang.question(key)))
    assert ask == needle.QUESTION.format(key=needle.KEYS[3]).lower().replace("?", " ?")


def test_the_tokenizer_reads_the_needle_as_the_model_was_trained_on_it(tmp_path: Path) -> None:
    """The written tokenizer gives the training ids: `<s>` first, lower-cased, "KEY is" merged."""
    from tokenizers import Tokenizer

    cfg = rm.TrainConfig()
    rm.write_tokenizer(tmp_path, cfg)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    lang = rm.Language(cfg)
    key, value = lang.keys[5], lang.values[42]
    text = needle.NEEDLE.format(key=needle.KEYS[5], value=needle.VALUES[42])
    assert tok.encode(text).ids == [rm.BOS, *lang.fact(key, value)]
    assert tok.encode(needle.QUESTION.format(key=needle.KEYS[5])).ids == [
        rm.BOS,
        *lang.question(key),
    ]


def test_filler_is_sentences_of_6_to_16_words_on_a_four_successor_markov_chain() -> None:
    """Successors are drawn 55/25/12/8 %, most likely first, so next tokens are predictable."""
    lang = rm.Language(rm.TrainConfig())
    text = lang.filler_text(40000, random.Random(5))
    assert len(text) == 40000
    sentences: list[list[int]] = [[]]
    for t in text:
        if t == lang.period:
            sentences.append([])
        else:
            sentences[-1].append(t)
    lengths = [len(s) for s in sentences[:-1]]  # the last may be cut short
    assert min(lengths) == 6 and max(lengths) == 16
    firsts = {lang.filler_text(20, random.Random(seed)).index(lang.period) for seed in range(300)}
    assert min(firsts) == 6 and max(firsts) == 16  # the opening sentence too
    rank = [0, 0, 0, 0]
    for s in sentences:
        for a, b in itertools.pairwise(s):
            rank[lang.successors[a].index(b)] += 1
    share = [r / sum(rank) for r in rank]
    for got, want in zip(share, (0.55, 0.25, 0.12, 0.08), strict=True):
        assert abs(got - want) < 0.02, share


@pytest.mark.parametrize(("length", "most"), [(48, 1), (240, 6), (768, 12)])
def test_a_training_sequence_asks_every_fact_and_marks_its_answers(length: int, most: int) -> None:
    """Facts (at most 12, 60 % of the sequence) all sit before the questions; every answer mask
    position holds the asked key's value, so the loss weighs exactly the answers."""
    lang = rm.Language(rm.TrainConfig())
    rng = random.Random(11)
    key_of = {v: k for k, v in lang.key_is.items()}
    counts = set()
    for _ in range(60):
        seq, answers = lang.sample(length, rng)
        assert len(seq) == length and seq[0] == rm.BOS
        facts = {seq[i + 4]: seq[i + 5] for i in range(len(seq)) if seq[i : i + 4] == lang.fact(
            lang.keys[0], 0)[:4] and seq[i + 4] in key_of}  # fmt: skip
        first_question = seq.index(lang.ids["what"])
        assert all(seq.index(k) < first_question for k in facts)
        assert len(answers) == len(facts)
        for a in answers:
            assert seq[a - 1] in key_of and seq[a] == facts[seq[a - 1]]
        counts.add(len(facts))
    assert min(counts) == 1 and max(counts) == most


def test_training_lengths_grow_from_min_len_to_max_len_over_the_first_half() -> None:
    """Step 0 trains at min_len; no step before the middle exceeds its share of the growth."""
    cfg = rm.TrainConfig(steps=40, batch=1, min_len=48, max_len=52)
    lang = rm.Language(cfg)
    batches = list(rm._batches(cfg, lang, random.Random(0)))
    lengths = [ids.shape[1] for ids, _ in batches]
    for ids, answers in batches:  # the loss weighs the answers: the mask marks values only
        assert answers.any() and set(ids[answers].tolist()) <= set(lang.values)
    assert len(lengths) == cfg.steps and lengths[0] == cfg.min_len
    for step, n in enumerate(lengths):
        assert cfg.min_len <= n <= cfg.min_len + min(1.0, step / 20) * 4
    assert max(lengths[:20]) < cfg.max_len and max(lengths[20:]) == cfg.max_len


def test_ensure_model_reuses_a_complete_cache_entry_and_rebuilds_a_partial_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry counts only with both weights and train.json, and a damaged one is replaced
    (the rename cannot land on it); the digest follows the config."""
    built: list[Path] = []

    def fake_train(cfg: rm.TrainConfig, out: Path, progress: object = None) -> Path:
        built.append(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.safetensors").write_text("w")
        (out / "train.json").write_text("{}")
        return out

    monkeypatch.setattr(rm, "train", fake_train)
    monkeypatch.setenv("HEADROOM_CACHE", str(tmp_path))
    cfg = rm.TrainConfig(steps=3)
    assert rm.digest(cfg) == rm.digest(rm.TrainConfig(steps=3)) != rm.digest(rm.TrainConfig())
    path = tmp_path / "models" / f"retrieval-{rm.digest(cfg)}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_text("half")  # an entry without train.json
    assert rm.ensure_model(cfg) == path and len(built) == 1  # rebuilt, not taken as built
    assert (path / "train.json").is_file() and (path / "model.safetensors").read_text() == "w"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no .tmp left behind
    assert rm.ensure_model(cfg) == path and len(built) == 1  # found, not trained again


# -- optional: the CUDA int8 write keeps NaN as the torch backend does -----------------------


@pytest.fixture(scope="module")
def cache_write_emulator() -> Any:
    """The cache-write kernels built for the host emulator (test_kernels_numerics' driver)."""
    from test_kernels_numerics import EmulatedRuntime, _driver_source, build_emulated

    variants = [v for v in kc.all_variants() if v.name.startswith("reshape_and_cache_")]
    return EmulatedRuntime(build_emulated(_driver_source(variants)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_int8_write_of_a_nan_row_stores_a_nan_scale_like_torch(
    cache_write_emulator: Any, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(3)
    hkv, d, n = 2, 64, 4
    x = torch.randn(n, hkv, d, generator=gen).to(dtype)
    x[0, 1, 5] = float("nan")  # lane 5 of the warp
    x[1, 0, 40] = float("nan")  # lane 8, second pass over the row
    x[2, 1, 63] = float("nan")  # the last lane
    slots = torch.tensor([3, 0, 7, 12])
    caches = []
    write: Callable[..., None]
    for write in (TorchBackend().write_kv, cb.CudaBackend(runtime=cache_write_emulator).write_kv):
        cache = allocate_layer_cache(1, 16, hkv, d, dtype, "int8")
        write(x, x, cache, slots)
        caches.append(cache)
    ref, got = caches
    for a, b in ((ref.k_scale, got.k_scale), (ref.v_scale, got.v_scale)):
        assert a is not None and b is not None
        assert torch.equal(a.isnan(), b.isnan()), (a, b)
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    nan_rows = x.isnan().any(-1)
    assert int(nan_rows.sum()) == 3
    for a, b in zip(ref.dequantized(), got.dequantized(), strict=True):
        a, b = a.view(-1, hkv, d)[slots], b.view(-1, hkv, d)[slots]
        assert a[nan_rows].isnan().all() and b[nan_rows].isnan().all()
    for a, b in ((ref.key, got.key), (ref.value, got.value)):
        codes = [t.view(-1, hkv, d)[slots][~nan_rows].int() for t in (a, b)]
        assert (codes[0] - codes[1]).abs().max() <= 1  # x / s vs torch's division: one ulp
