"""`headroom kv-check`: its pieces (prompts, needles, metrics, verdicts, scales), its errors
(exit 2 with the reason), and the whole command on the retrieval model trained here.

The fast tests use a two-step, untrained build of the retrieval model (a real Hugging Face
directory the engine's loader reads); the slow ones use the trained model, built once and
cached under $HEADROOM_CACHE/models (about 10-25 minutes on 2 busy cores the first time).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import headroom.engine.attention as attention
from headroom.contract.cli import main as headroom
from headroom.engine.attention import TorchBackend
from headroom.engine.attention.kv_scales import (
    SCALES_FILE,
    KVScales,
    KVScalesError,
    apply_scales,
    read_scales,
    write_scales,
)
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.kernels import compile as kc
from headroom.engine.kv_check import check, metrics, needle
from headroom.engine.kv_check import cli as kv_cli
from headroom.engine.kv_check import retrieval_model as rm
from headroom.engine.kv_check.calibrate import MARGIN, calibrate
from headroom.engine.kv_check.cli import parse_contexts
from headroom.engine.kv_check.prompts import Haystacks, PromptsError, read_documents
from headroom.engine.kv_check.session import KVSetting, Session
from headroom.engine.model import load_model

QUICK = rm.TrainConfig(steps=2, batch=2, min_len=48, max_len=48)


@pytest.fixture(scope="module")
def untrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real model directory of the retrieval architecture after two training steps."""
    return rm.train(QUICK, tmp_path_factory.mktemp("untrained") / "model")


@pytest.fixture(scope="module")
def trained() -> Path:
    return rm.ensure_model()


# -- pieces --------------------------------------------------------------------------------


def test_contexts_parse_k_suffixes_and_reject_garbage() -> None:
    assert parse_contexts("1k, 4k,16k") == (1024, 4096, 16384)
    assert parse_contexts("512,1k,512") == (512, 1024)
    for bad in ("4q", "", "0", "-1k"):
        with pytest.raises(ValueError):
            parse_contexts(bad)


def test_the_needle_is_spliced_at_its_depth_and_the_question_closes_the_prompt() -> None:
    hay = list(range(100, 110))
    out = needle.insert_at_depth(hay, [1, 2], [9], 0.5)
    assert out == [100, 101, 102, 103, 104, 1, 2, 105, 106, 107, 108, 109, 9]
    assert needle.insert_at_depth(hay, [1], [9], 0.0)[:2] == [1, 100]
    assert needle.insert_at_depth(hay, [1], [9], 1.0)[-2:] == [1, 9]
    with pytest.raises(ValueError, match="depth"):
        needle.insert_at_depth(hay, [1], [9], 1.5)


def test_needles_are_seeded_and_scored_on_the_leading_value() -> None:
    assert needle.draw_needles(5, seed=3) == needle.draw_needles(5, seed=3)
    assert len({n.key for n in needle.draw_needles(10, seed=1)}) == 10
    assert needle.answered(" 472 . the", "472")
    assert not needle.answered(" 47 2", "472")
    assert not needle.answered("the 472", "472")


def test_a_longer_number_does_not_answer_the_needle() -> None:
    for text, value in ((" 1234.", "123"), (" 472.5", "472"), (" 4720 . the", "472")):
        assert not needle.answered(text, value), text
    for text in (" 472", " 472.", "472. The", " 472 . the", "472,", "472\n\nQ"):
        assert needle.answered(text, "472"), text


def test_metrics_of_identical_and_different_logits() -> None:
    a = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    assert metrics.top1_agreement(a, a) == 1.0
    assert metrics.kl_divergence(a, a) == pytest.approx(0.0, abs=1e-12)
    b = torch.tensor([[3.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    assert metrics.top1_agreement(a, b) == 0.5
    assert metrics.kl_divergence(a, b) > 0.1
    assert metrics.matched_prefix([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert metrics.matched_prefix([1, 2], [1, 2]) == 2


def test_documents_are_read_from_jsonl_json_and_text(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"prompt": "two"}\n"three"\n')
    assert read_documents(tmp_path / "a.jsonl") == ["one", "two", "three"]
    (tmp_path / "b.json").write_text('["x", {"text": "y"}]')
    assert read_documents(tmp_path / "b.json") == ["x", "y"]
    (tmp_path / "c.txt").write_text("just text\n")
    assert read_documents(tmp_path / "c.txt") == ["just text\n"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.jsonl", None, "does not exist"),
        ("empty.jsonl", "  \n", "is empty"),
        ("bad.jsonl", '{"text": "ok"}\n{oops\n', "line 2 is not valid JSON"),
        ("deep.jsonl", "[" * 100_000, "line 1 is not valid JSON: nested too deeply"),
        ("deep.json", "[" * 100_000, "is not valid JSON: nested too deeply"),
        ("nofield.jsonl", '{"body": "x"}\n', "line 1: an object needs a string 'text'"),
        ("blank.jsonl", '{"text": "   "}\n', "line 1: the document is empty"),
        ("obj.json", '{"text": "x"}', "expected a non-empty JSON array"),
        ("num.json", "[1]", "item 0: expected a string or an object, got int"),
    ],
)
def test_bad_prompts_files_say_what_is_wrong(
    tmp_path: Path, name: str, content: str | None, message: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(PromptsError, match=message):
        read_documents(path)


def test_haystack_windows_start_apart_and_wrap_around() -> None:
    hay = Haystacks([[1, 2, 3], [4, 5]], bos=0)
    assert hay.window(0, 4, 2) == [1, 2, 3, 4]
    assert hay.window(1, 4, 2) == [3, 4, 5, 1]  # starts halfway, wraps
    assert hay.with_bos([7]) == [0, 7]
    with pytest.raises(PromptsError, match="no tokens"):
        Haystacks([[], []], bos=None)


def _row(name: str, needle_score: float, top1: float = 1.0) -> check.SettingResult:
    return check.SettingResult(
        setting=name,
        kv_dtype="fp8",
        top1_agreement=top1,
        kl_divergence=0.0,
        greedy_match_tokens=1.0,
        greedy_full_match=1.0,
        needle_score=needle_score,
        needle_trials=20,
    )


def test_the_verdict_names_the_last_safe_context_and_what_broke_after_it() -> None:
    results = [
        check.ContextResult(context=c, settings=[_row("auto", a), _row("fp8", q, t)])
        for c, a, q, t in ((1024, 1.0, 1.0, 0.99), (4096, 0.95, 0.95, 0.97),
                           (16384, 0.95, 0.40, 0.95))
    ]  # fmt: skip
    assert check.verdict(results, "fp8") == (
        "fp8 safe up to 4k; at 16k the needle score drops from 0.95 to 0.40"
    )
    first = [check.ContextResult(context=1024, settings=[_row("auto", 1.0), _row("fp8", 1, 0.5)])]
    assert check.verdict(first, "fp8") == "fp8 not safe at 1k: top-1 agreement is 50% (< 90%)"
    assert check.verdict(results[:2], "fp8").startswith("fp8 safe at every context checked")
    weak = [check.ContextResult(context=512, settings=[_row("auto", 0.2), _row("fp8", 0.2)])]
    assert check.caveats(weak) == [
        "at 512 the model retrieves poorly even with the auto cache (needle 0.20), so the "
        "needle score there says little"
    ]


# -- scales --------------------------------------------------------------------------------


def test_scales_files_round_trip_and_refuse_what_does_not_fit(tmp_path: Path) -> None:
    scales = KVScales(k_scale=[[0.5, 0.25]], v_scale=[[1.0, 2.0]], source="test")
    write_scales(scales, tmp_path / SCALES_FILE)
    assert read_scales(tmp_path / SCALES_FILE) == scales
    (tmp_path / "bad.json").write_text('{"k_scale": [[0]], "v_scale": [[1]]}')
    with pytest.raises(KVScalesError, match="positive finite"):
        read_scales(tmp_path / "bad.json")
    from headroom.engine.attention import allocate_layer_cache

    caches = [allocate_layer_cache(2, 16, 2, 64, torch.float32, "fp8")]
    apply_scales(caches, scales)
    assert caches[0].k_scale is not None and caches[0].k_scale.tolist() == [0.5, 0.25]
    with pytest.raises(KVScalesError, match="2 layers, the model has 1"):
        apply_scales(caches, KVScales(k_scale=[[1.0, 1.0]] * 2, v_scale=[[1.0, 1.0]] * 2))
    with pytest.raises(KVScalesError, match="has 3 heads, the model has 2"):
        apply_scales(caches, KVScales(k_scale=[[1.0] * 3], v_scale=[[1.0] * 2]))


def test_the_engine_starts_with_the_scales_found_in_the_model_directory(
    untrained: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(untrained, model)
    k = [[0.125 * (i + 1)] * QUICK.kv_heads for i in range(QUICK.layers)]
    write_scales(KVScales(k_scale=k, v_scale=k), model / SCALES_FILE)
    engine = Engine.from_config(EngineConfig(model=str(model), kv_cache_dtype="fp8", num_blocks=8))
    assert [c.k_scale.tolist() for c in engine.runner.caches if c.k_scale is not None] == k
    plain = Engine.from_config(
        EngineConfig(model=str(untrained), kv_cache_dtype="fp8", num_blocks=8)
    )
    ones = [1.0] * QUICK.kv_heads
    assert all(c.k_scale is not None and c.k_scale.tolist() == ones for c in plain.runner.caches)


def test_calibrated_scales_rescue_fp8_when_keys_exceed_its_range(untrained: Path) -> None:
    """Keys scaled up 1000x (queries down 10x, so attention is sharp enough to matter) put K
    far past e4m3's 448: scale 1.0 saturates them, the calibrated scales do not."""
    loaded = load_model(str(untrained))
    model = loaded.model
    with torch.no_grad():
        for layer in model.model.layers:
            q, kv = layer.self_attn.q_size, layer.self_attn.kv_size
            w = layer.self_attn.qkv_proj.weight
            w[:q] *= 0.1
            w[q : q + kv] *= 1000.0
    docs = (untrained / "documents.jsonl").read_text().splitlines()
    tokens = loaded.tokenizer.encode(json.loads(docs[0])["text"])[:160]
    backend, cpu = TorchBackend(), torch.device("cpu")
    scales = calibrate(model, backend, cpu, [tokens[:128]], source="test")
    # absmax = scale * 448 / MARGIN: the keys reach past what scale 1.0 can hold.
    assert all(s * 448 / MARGIN > 448 for row in scales.k_scale for s in row)

    def logits(setting: KVSetting) -> torch.Tensor:
        return Session(model, backend, setting, cpu).next_token_logits(tokens, 128)

    ref = logits(KVSetting("auto", "auto"))
    naive = logits(KVSetting("fp8", "fp8"))
    calibrated = logits(KVSetting("fp8 calibrated", "fp8", scales))
    assert metrics.kl_divergence(ref, naive) > 2 * metrics.kl_divergence(ref, calibrated)
    assert metrics.top1_agreement(ref, calibrated) > metrics.top1_agreement(ref, naive)


# -- the command ---------------------------------------------------------------------------


def _args(model: Path | str, prompts: Path, *extra: str) -> list[str]:
    return ["kv-check", "--model", str(model), "--prompts", str(prompts), *extra]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--kv-cache-dtype", "fp8", "--contexts", "4q"), "--contexts: '4q' is not a number"),
        (("--kv-cache-dtype", "int8", "--calibrate"), "--calibrate derives static fp8 scales"),
        (("--kv-cache-dtype", "fp8", "--contexts", "64k"), "exceeds the model's max_position"),
        (("--kv-cache-dtype", "fp8", "--depths", "0.5,2"), "--depths"),
        (("--kv-cache-dtype", "fp8", "--num-prompts", "0"), "--num-prompts must be at least 1"),
        (("--kv-cache-dtype", "fp8", "--contexts", "8"), "is too short for the needle"),
        (("--kv-cache-dtype", "fp8", "--plot", "kv.txt"), "--plot: kv.txt must end in .png"),
    ],
)
def test_bad_options_exit_2_with_the_reason(
    untrained: Path,
    capsys: pytest.CaptureFixture[str],
    extra: tuple[str, ...],
    message: str,
) -> None:
    rc = headroom(_args(untrained, untrained / "documents.jsonl", *extra, "--quiet"))
    assert rc == 2
    assert message in capsys.readouterr().err


def test_the_needle_answer_counts_against_max_position_embeddings() -> None:
    loaded = load_model("tiny")
    limit = loaded.config.max_position_embeddings
    needle_tokens = check.longest_needle_tokens(loaded.tokenizer)
    assert needle_tokens > 2

    def validate(context: int) -> check.CheckConfig:
        args = argparse.Namespace(
            contexts=str(context), num_prompts=1, depths="0.5", positions=1, greedy_tokens=1,
            seed=0, calibrate=False, kv_cache_dtype="int8",
        )  # fmt: skip
        return kv_cli._validate(args, loaded)

    with pytest.raises(kv_cli.UsageError, match=f"plus {needle_tokens} generated tokens"):
        validate(limit - 2)  # room for the greedy and teacher-forced tokens, not the needle's
    assert validate(limit - needle_tokens).contexts == (limit - needle_tokens,)


def test_calibrate_without_a_place_for_the_scales_exits_2_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = tmp_path / "docs.txt"
    docs.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    rc = headroom(_args("tiny", docs, "--kv-cache-dtype", "fp8", "--calibrate", "--contexts",
                        "160", "--num-prompts", "1", "--depths", "0.5"))  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2
    assert "--calibrate needs --scales-out: tiny is not a model directory" in err
    assert "loading" not in err and "calibrating" not in err


def test_a_model_the_engine_cannot_load_exits_2(
    untrained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = untrained / "documents.jsonl"
    assert headroom(_args(tmp_path / "nowhere", docs, "--kv-cache-dtype", "fp8")) == 2
    assert "cannot load model" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(untrained, broken)
    (broken / "tokenizer.json").unlink()
    assert headroom(_args(broken, docs, "--kv-cache-dtype", "int8", "--quiet")) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert headroom(_args(untrained, tmp_path / "none.jsonl", "--kv-cache-dtype", "fp8")) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ((), "the model runs in float32"),  # --dtype auto is float32 on CPU
        (("--dtype", "bfloat16"), "head_dim (128,), the model has 64"),
    ],
)
def test_a_cuda_backend_the_model_does_not_fit_exits_2_before_the_check(
    untrained: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: tuple[str, ...],
    message: str,
) -> None:
    # As on a GPU host with CuPy; kernels built for head_dim 128 only. The model's head_dim and
    # dtype reach select_backend, so the refusal is not left to the first kernel launch.
    monkeypatch.setattr(attention, "_cuda_backend_status", lambda dev: None)
    monkeypatch.setattr(kc, "HEAD_DIMS", (128,))

    def no_check(*_: object, **__: object) -> None:
        raise AssertionError("the check ran on a backend that cannot run the model")

    monkeypatch.setattr(check, "run_check", no_check)
    args = _args(untrained, untrained / "documents.jsonl", "--kv-cache-dtype", "int8", *extra)
    assert headroom([*args, "--attention-backend", "cuda", "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_kv_check_json_to_stdout_is_the_json_alone(
    untrained: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `--json -` wrote a file named "-" in the working directory, the table on stdout.
    monkeypatch.chdir(tmp_path)
    rc = headroom(
        _args(
            untrained, untrained / "documents.jsonl", "--kv-cache-dtype", "int8",
            "--contexts", "96", "--num-prompts", "1", "--depths", "0.5",
            "--positions", "4", "--greedy-tokens", "4", "--json", "-", "--quiet",
        )
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert rc in (0, 1) and not (tmp_path / "-").exists()
    assert [c["context"] for c in json.loads(out)["contexts"]] == [96]
    assert "verdict: int8" in err


def test_kv_check_runs_end_to_end_and_writes_json_and_png(
    untrained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = headroom(
        _args(
            untrained, untrained / "documents.jsonl", "--kv-cache-dtype", "int8",
            "--contexts", "96,160", "--num-prompts", "1", "--depths", "0.5",
            "--positions", "4", "--greedy-tokens", "4",
            "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
        )
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert rc in (0, 1)
    assert "[" in err and "context 160, int8" in err  # progress
    report = json.loads((tmp_path / "r.json").read_text())
    assert [c["context"] for c in report["contexts"]] == [96, 160]
    assert [s["setting"] for s in report["contexts"][0]["settings"]] == ["auto", "int8"]
    assert report["verdicts"][0].startswith("int8 ")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "verdict: int8" in out


# -- the trained model ---------------------------------------------------------------------


def test_training_is_deterministic(tmp_path: Path) -> None:
    cfg = replace(QUICK, steps=3)
    a = rm.train(cfg, tmp_path / "a")
    b = rm.train(cfg, tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kv_check_on_the_trained_model_calibrates_fp8_and_finds_the_needles(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    shutil.copytree(trained, model)
    rc = headroom(
        _args(
            model, model / "documents.jsonl", "--kv-cache-dtype", "fp8", "--calibrate",
            "--contexts", "256,1k", "--num-prompts", "2", "--depths", "0.1,0.5,0.9",
            "--positions", "16", "--greedy-tokens", "16", "--json", str(tmp_path / "r.json"),
        )
    )  # fmt: skip
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    settings = [s["setting"] for s in report["contexts"][0]["settings"]]
    assert settings == ["auto", "fp8 (scale 1.0)", "fp8 calibrated"]
    for ctx in report["contexts"]:
        auto = ctx["settings"][0]
        # The model retrieves: the needle score means something.
        assert auto["needle_score"] >= 0.8, ctx
        for row in ctx["settings"][1:]:
            assert row["top1_agreement"] >= 0.9, row
    scales = read_scales(model / SCALES_FILE)
    assert scales.num_layers == rm.TrainConfig().layers
    assert report["scales_path"] == str(model / SCALES_FILE)
    calibrated = [v for v in report["verdicts"] if v.startswith("fp8 calibrated")]
    assert len(calibrated) == 1  # the status follows the cache deployed, not scale 1.0's row
    assert rc == (0 if "safe at every context" in calibrated[0] else 1)
    assert "verdict: fp8 calibrated" in out


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_on_the_trained_model_saturated_keys_lose_the_needle_and_calibration_finds_it(
    trained: Path,
) -> None:
    """The lookup head's keys scaled up 1000x (its queries down 1000x: the model computes the
    same) go past e4m3's 448: with scale 1.0 they saturate and the needle is lost; the scales
    calibrated on the documents keep it."""
    loaded = load_model(str(trained))
    model, tok = loaded.model, loaded.tokenizer
    with torch.no_grad():
        attn = model.model.layers[1].self_attn
        q, kv = attn.q_size, attn.kv_size
        attn.qkv_proj.weight[:q] /= 1000.0
        attn.qkv_proj.weight[q : q + kv] *= 1000.0
    docs = read_documents(trained / "documents.jsonl")
    hay = Haystacks([tok.encode(d, add_special_tokens=False) for d in docs], tok.bos_token_id)
    backend, cpu = TorchBackend(), torch.device("cpu")
    scales = calibrate(model, backend, cpu, [hay.with_bos(hay.window(0, 1023, 1))], "test")
    cfg = check.CheckConfig(contexts=(1024,), num_prompts=4, depths=(0.2, 0.5, 0.8))
    trials = check.needle_prompts(tok, hay, 1024, cfg)

    def score(setting: KVSetting) -> float:
        session = Session(model, backend, setting, cpu)
        got = [
            needle.answered(tok.decode(session.greedy(ids, 1)), nd.value) for ids, nd, _ in trials
        ]
        return sum(got) / len(got)

    assert score(KVSetting("auto", "auto")) >= 0.9
    assert score(KVSetting("fp8 calibrated", "fp8", scales)) >= 0.9
    assert score(KVSetting("fp8", "fp8")) <= 0.5


def test_the_exit_status_grades_only_the_cache_that_is_deployed() -> None:
    """With --calibrate the engine loads the calibrated scales: an unsafe scale-1.0 row (shown
    to say what calibration buys) must not fail a run whose calibrated cache is safe."""

    def row(setting: str, needle: float, top1: float) -> check.SettingResult:
        return check.SettingResult(
            setting=setting, kv_dtype="fp8", top1_agreement=top1, kl_divergence=0.0,
            greedy_match_tokens=1.0, greedy_full_match=1.0, needle_score=needle, needle_trials=4,
        )  # fmt: skip

    rows = [row("auto", 1.0, 1.0), row("fp8 (scale 1.0)", 0.25, 0.5),
            row("fp8 calibrated", 1.0, 0.99)]  # fmt: skip
    results = [check.ContextResult(context=c, settings=rows) for c in (256, 1024)]
    assert check.all_safe(results, "fp8 calibrated")
    assert not check.all_safe(results, "fp8 (scale 1.0)")
