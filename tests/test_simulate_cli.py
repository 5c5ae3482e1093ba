"""`headroom profile` and `headroom simulate` as a user runs them: on the published traces and on
files written here, with the exit codes, the messages on bad input, the YAML they print, the PNG
they draw and the progress they show."""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import numpy as np
import pytest
import yaml

from headroom.contract.cli import EXTRAS, extra_for, main
from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.simulate.cli import UsageError, add_parsers, quantiles
from headroom.operator.simulate.specfile import read_spec

REPO = Path(__file__).resolve().parents[1]
AZURE = REPO / "bench" / "traces" / "azure-llm-2023-conv.csv"
MOONCAKE = REPO / "bench" / "traces" / "mooncake-synthetic.jsonl"
EXAMPLE = REPO / "examples" / "llama-3.1-8b-h100.yaml"
BASE = {"model": {"preset": "llama-3.1-8b"}, "gpu": {"type": "h100-80gb"}}


def headroom(
    *args: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "headroom.contract.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )


def pasted(stdout: str) -> dict[str, object]:
    """The YAML block that ends the profile report."""
    block = stdout[stdout.index("# spec.traffic and spec.scaling") :]
    doc = yaml.safe_load(block)
    assert isinstance(doc, dict) and set(doc) == {"traffic", "scaling"}
    return doc


def in_process(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str]:
    """(exit code, stderr) of the CLI run in this process: quicker than a subprocess for the
    many ways an input can be wrong (an uncaught exception fails the test)."""
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def assert_clean_exit_2(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr


def short_trace(path: Path, minutes: float = 6.0) -> Path:
    """A few minutes of generic CSV: 2 requests/s rising to 8, prompts of 500-3,000 tokens."""
    rng = np.random.default_rng(3)
    seconds = minutes * 60
    t = np.sort(rng.uniform(0, seconds, int(5 * seconds)))
    keep = rng.uniform(0, 1, len(t)) < (2 + 6 * t / seconds) / 8
    t = t[keep]
    rows = [
        f"{a:.3f},{p},{o}"
        for a, p, o in zip(
            t, rng.integers(500, 3001, len(t)), rng.integers(50, 400, len(t)), strict=True
        )
    ]
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    return path


def ramp_trace(path: Path) -> Path:
    """15 quiet minutes at 0.2 requests/s, then a ramp to 1.2 within a minute, held for ten:
    faster than a 60 s pod start lets any forecast follow from one pod."""
    rng = np.random.default_rng(5)
    t, arrivals = 0.0, []
    while t < 1500:
        rate = 0.2 if t < 900 else min(1.2, 0.2 + (t - 900) / 60)
        t += rng.exponential(1 / rate)
        arrivals.append(t)
    n = len(arrivals)
    rows = zip(arrivals, rng.integers(500, 3001, n), rng.integers(200, 600, n), strict=True)
    lines = [f"{a:.3f},{p},{o}" for a, p, o in rows]
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "\n".join(lines) + "\n")
    return path


def spec_file(path: Path, **scaling: object) -> Path:
    doc = {
        "apiVersion": "headroom.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "chat"},
        "spec": {
            "model": {"preset": "llama-3.1-8b"},
            "gpu": {"type": "l4-24gb"},
            "traffic": {"peakConcurrency": 64, "contextTokens": 3400},
            "engine": {"maxModelLen": 4096},
            "scaling": {"minReplicas": 1, "maxReplicas": 12, "podStartSeconds": 60, **scaling},
        },
    }
    path.write_text(yaml.safe_dump(doc))
    return path


# ------------------------------------------------------------------------------------- profile


def test_profile_of_the_azure_trace_prints_every_figure_and_a_spec_the_models_accept() -> None:
    r = headroom("profile", AZURE)
    assert r.returncode == 0, r.stderr
    for label in (
        "in flight",
        "KV tokens",
        "prompt + output",
        "per 60 s",
        "prefix overlap",
        "paging           always",
        "prefix caching   unknown",
        "headroom kv-check",
    ):
        assert label in r.stdout, label
    assert r.stderr == ""  # stderr is not a terminal and --progress was not given
    doc = pasted(r.stdout)
    traffic = doc["traffic"]
    assert isinstance(traffic, dict) and traffic["contextTokens"] == 4136  # p95 of the README
    assert traffic["prefixHitRatio"] == 0.0  # Azure's trace has no prefix identity
    assert "minReplicas" not in doc["scaling"]  # type: ignore[operator]
    InferenceDeploymentSpec.model_validate({**BASE, **doc})


def test_profile_for_a_model_and_gpu_sizes_min_and_max_replicas() -> None:
    r = headroom("profile", AZURE, "--model", "llama-3.1-8b", "--gpu", "l4-24gb")
    assert r.returncode == 0, r.stderr
    doc = pasted(r.stdout)
    scaling = doc["scaling"]
    assert isinstance(scaling, dict)
    assert 1 <= scaling["minReplicas"] < scaling["maxReplicas"] <= 16
    assert "KV quantization  only after validation" in r.stdout
    spec = InferenceDeploymentSpec.model_validate({**BASE, "gpu": {"type": "l4-24gb"}, **doc})
    assert spec.scaling.min_replicas == scaling["minReplicas"]


def test_profile_of_the_mooncake_trace_as_json_finds_its_prefix_overlap() -> None:
    r = headroom("profile", MOONCAKE, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["requests"] == 3_993
    assert 0.64 <= out["ideal_hit_ratio"] <= 0.66
    advice = {a["topic"]: a["decision"] for a in out["verdict"]}
    assert advice == {
        "paging": "always",
        "prefix caching": "on (engine.prefixCaching: true)",
        "KV quantization": "not sized",
    }
    # 65% of prompt tokens were seen before, mostly by the turn before, long finished: requests
    # in flight together share little, and that is all sharing saves in memory.
    shared = out["shared_in_flight"]
    assert shared["10"] == 0.0 and 0.0 < shared["90"] < 0.2
    assert out["spec"]["traffic"]["prefixHitRatio"] == 0.0
    assert yaml.safe_load(out["spec_yaml"]) == out["spec"]
    InferenceDeploymentSpec.model_validate({**BASE, **out["spec"]})


def test_profile_with_a_spec_keeps_its_scaling_and_names_what_its_max_length_refuses() -> None:
    r = headroom("profile", MOONCAKE, "--spec", EXAMPLE)
    assert r.returncode == 0, r.stderr
    doc = pasted(r.stdout)
    assert doc["scaling"]["targetOccupancy"] == 0.7  # type: ignore[index]  # the example's
    assert "engine.maxModelLen 8,192 refuses" in r.stdout
    assert "(the model's limit)" in r.stdout  # llama-3.1-8b takes 131,072 tokens at most
    # The trace's p95 context is over the example's maxModelLen: the block suggests the most
    # the engine takes, so pasted into the example it is a spec the CRD accepts.
    assert doc["traffic"]["contextTokens"] == 8192  # type: ignore[index]
    assert "capped at the engine's max length 8,192" in r.stdout
    example = yaml.safe_load(Path(EXAMPLE).read_text())["spec"]
    pasted_in = {**example, "traffic": doc["traffic"],
                 "scaling": {**example["scaling"], **doc["scaling"]}}  # type: ignore[dict-item]  # fmt: skip
    InferenceDeploymentSpec.model_validate(pasted_in)


def test_profile_with_a_near_zero_target_occupancy_sizes_the_most_pods_not_a_traceback(
    tmp_path: Path,
) -> None:
    # The CRD takes any target above 0: 1e-310 made the pods for the peak infinite, and
    # `math.ceil` raised (exit 1, a traceback) where decide() asks for the most pods.
    doc = yaml.safe_load(Path(EXAMPLE).read_text())
    doc["spec"]["scaling"].update(targetOccupancy=1e-310, scaleInHysteresis=0)
    spec = tmp_path / "tiny-target.yaml"
    spec.write_text(yaml.safe_dump(doc))
    r = headroom("profile", MOONCAKE, "--spec", str(spec))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "2,147,483,647" in r.stdout, r.stdout


def test_profile_at_twice_the_rate_doubles_the_requests() -> None:
    one = json.loads(headroom("profile", MOONCAKE, "--json").stdout)
    two = json.loads(headroom("profile", MOONCAKE, "--json", "--rate", "2").stdout)
    assert two["requests"] == 2 * one["requests"]
    assert two["concurrency"]["50"] > 1.6 * one["concurrency"]["50"]


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        (
            "bad.csv",
            "arrival_s,prompt_tokens,output_tokens\n0,10,10\n1,ten,10\n",
            "bad.csv:3: prompt_tokens must be an integer",
        ),
        (
            "bad.jsonl",
            '{"timestamp": 0, "input_length": 10, "output_length": 1}\nnot json\n',
            "bad.jsonl:2: not JSON",
        ),
        ("notes.txt", "dear diary\n", "notes.txt:1: not a trace this reads"),
        ("empty.csv", "", "empty.csv: empty file"),
    ],
)
def test_profile_of_a_bad_file_exits_2_with_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, text: str, needle: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    code, err = in_process(capsys, "profile", path)
    assert code == 2 and err.startswith("headroom profile: ") and needle in err, err


def test_a_bad_file_exits_2_with_the_line_and_no_traceback_from_the_installed_command(
    tmp_path: Path,
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,10\n1,10,0\n")
    assert_clean_exit_2(headroom("profile", path), "bad.csv:3: output_tokens must be at least 1")
    assert_clean_exit_2(
        headroom("simulate", path, "--spec", EXAMPLE), "bad.csv:3: output_tokens must be at least 1"
    )
    assert_clean_exit_2(headroom("profile", tmp_path / "gone.csv"), "gone.csv: cannot read")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--rate", "0"], "--rate must be a positive number"),
        (["--decode-tps", "-1"], "--decode-tps must be a positive number"),
        # A profile keeps a count per second until the last request ends: not a terabyte.
        (["--decode-tps", "1e-9"], "make a request last 11,574,074 days (at most 31)"),
        (["--block-size", "0"], "--block-size must be in [1, 1024]"),
        (["--model", "llama-3.1-8b"], "--model and --gpu go together"),
        (["--model", "llama-9", "--gpu", "l4-24gb"], "unknown model 'llama-9'"),
        (["--model", "llama-3.1-70b", "--gpu", "l4-24gb"], "exceed"),  # weights do not fit
        (["--format", "mooncake"], "not JSON"),
    ],
)
def test_profile_with_a_bad_argument_exits_2_with_the_reason(
    capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    code, err = in_process(capsys, "profile", AZURE, *args)
    assert code == 2 and needle in err, err


# ------------------------------------------------------------------------------------ simulate


def test_simulate_on_a_short_trace_prints_the_table_and_writes_the_png(tmp_path: Path) -> None:
    trace = short_trace(tmp_path / "short.csv")
    png = tmp_path / "out" / "sweep.png"
    png.parent.mkdir()
    r = headroom(
        "simulate",
        trace,
        "--spec",
        spec_file(tmp_path / "chat.yaml"),
        "--quantiles",
        "0.95,0.6",
        "--seeds",
        "2",
        "--png",
        png,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("quantile"))
    labels = ("GPU-h", "limited s", "worst s", "full s", "queued s", "peak pods", "starts")
    for label in (*labels, "cancelled", "refused"):
        assert label in lines[header]
    rows = lines[header + 1 : header + 3]
    assert [row.split()[0] for row in rows] == ["0.60", "0.95"]
    picked = [row for row in rows if row.endswith("<- pick")]
    assert len(picked) <= 1
    assert ("no setting serves" in r.stdout) == (not picked)
    assert "llama-3.1-8b on 1x l4-24gb" in r.stdout and "2 seeds" in r.stdout
    text = " ".join(r.stdout.split())  # the advice wraps
    assert "floor " in text and "the fewest any autoscaler could spend" in text
    assert ("the pick costs" in text) == bool(picked)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_as_json_reports_every_run_and_the_pick(tmp_path: Path) -> None:
    trace = short_trace(tmp_path / "short.csv", minutes=4)
    r = headroom(
        "simulate",
        trace,
        "--spec",
        spec_file(tmp_path / "chat.yaml"),
        "--quantiles",
        "0.7",
        "--seeds",
        "2",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (setting,) = out["settings"]
    assert setting["forecast_quantile"] == 0.7 and [run["seed"] for run in setting["runs"]] == [
        1,
        2,
    ]
    assert setting["median"]["gpu_hours"] > 0
    assert out["cheapest_serving_quantile"] == (0.7 if setting["serves"] else None)
    floor = out["clairvoyant_floor"]
    assert floor["allowed_seconds"] == 30 and len(floor["gpu_hours"]) == 2
    # A lower bound: no run of the setting costs less than its seed's floor for 30 s short.
    for run, f in zip(setting["runs"], floor["gpu_hours"], strict=True):
        assert 0 < f <= run["gpu_hours"] or run["limited_seconds"] > 30
    assert floor["gpu_hours_median"] == pytest.approx(sum(floor["gpu_hours"]) / 2)


def test_simulate_finds_the_standing_reserve_a_ramp_needs_when_nothing_else_serves(
    tmp_path: Path,
) -> None:
    """No quantile serves a ramp that outruns the pod start from one pod: the sweep is tried
    again at minReplicas 2, 3, ... until one serves, on the same seeds, and that is the pick.
    A spec already at that minReplicas serves and tries no reserve."""
    trace = ramp_trace(tmp_path / "ramp.csv")
    r = headroom("simulate", trace, "--spec", spec_file(tmp_path / "chat.yaml"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["min_replicas"] == 1 and out["cheapest_serving_quantile"] is None
    assert not any(s["serves"] for s in out["settings"])
    reserves = out["reserves"]
    assert [x["min_replicas"] for x in reserves] == list(range(2, 2 + len(reserves)))
    *missed, held = reserves
    assert all(x["cheapest_serving_quantile"] is None for x in missed)
    pick = next(
        s for s in held["settings"] if s["forecast_quantile"] == held["cheapest_serving_quantile"]
    )
    assert pick["serves"] and pick["median"]["limited_seconds"] <= 30
    assert [run["seed"] for run in pick["runs"]] == [1, 2, 3]
    assert pick["median"]["gpu_hours"] == min(
        s["median"]["gpu_hours"] for s in held["settings"] if s["serves"]
    )

    n = held["min_replicas"]
    assert out["pick"] == {"min_replicas": n, "forecast_quantile": pick["forecast_quantile"]}

    # The reserve is the spec at that minReplicas, replayed from the same openings: run so, it
    # serves by itself, the same runs to the second, and tries no reserve.
    again = spec_file(tmp_path / "held.yaml", minReplicas=n)
    r = headroom("simulate", trace, "--spec", again, "--json")
    assert r.returncode == 0, r.stderr
    direct = json.loads(r.stdout)
    assert direct["min_replicas"] == n and direct["reserves"] == []
    assert direct["settings"] == held["settings"]
    assert direct["cheapest_serving_quantile"] == held["cheapest_serving_quantile"]
    assert direct["pick"] == out["pick"]


def test_simulate_prints_and_draws_the_standing_reserve_it_picks(tmp_path: Path) -> None:
    """The reserves tried, each as a table; the deploy line names minReplicas; the chart draws
    the reserve that serves."""
    png = tmp_path / "sweep.svg"
    r = headroom("simulate", ramp_trace(tmp_path / "ramp.csv"), "--spec",
                 spec_file(tmp_path / "chat.yaml"), "--png", png)  # fmt: skip
    assert r.returncode == 0, r.stderr
    heads = [line for line in r.stdout.splitlines() if line.startswith("with minReplicas")]
    assert heads and heads[-1].endswith("(a standing reserve): serves")
    assert all(h.endswith("no setting serves") for h in heads[:-1])
    n = int(heads[-1].split()[2])
    text = " ".join(r.stdout.split())
    assert "no setting serves with minReplicas 1, and one does with a standing reserve" in text
    assert f"set scaling.minReplicas: {n}, forecastQuantile:" in text
    assert "the pick costs" in text
    assert r.stdout.count("<- pick") == 1
    assert f"with minReplicas {n} (a standing reserve)" in png.read_text()  # its legend


def test_simulate_takes_a_spec_alone_in_json(tmp_path: Path) -> None:
    trace = short_trace(tmp_path / "short.csv", minutes=3)
    doc = yaml.safe_load(spec_file(tmp_path / "chat.yaml").read_text())["spec"]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(doc, indent="\t"))  # tabs: JSON is read as JSON, not as YAML
    r = headroom("simulate", trace, "--spec", spec, "--quantiles", "0.9", "--seeds", "1")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (
            "spec:\n  model: {preset: llama-3.1-8b}\n  gpu: {type: l4-24gb}\n  traffic:\n"
            "    peakConcurrency: 0\n    contextTokens: 100\n",
            [":5: spec.traffic.peakConcurrency: Input should be greater than or equal to 1"],
        ),
        ("kind: Deployment\nspec: {}\n", ["kind is 'Deployment', not InferenceDeployment"]),
        ("spec:\n  model: [unclosed\n", ["not YAML or JSON"]),
        ("- a\n- b\n", ["expected a mapping"]),
        (
            "model: {preset: llama-3.1-70b}\ngpu: {type: l4-24gb}\n"
            "traffic: {peakConcurrency: 1, contextTokens: 100}\n",
            ["this pod cannot serve: weights"],
        ),
        (
            "model: {preset: llama-3.1-8b}\ngpu: {type: l4-24gb}\n"
            "traffic: {peakConcurrency: 1, contextTokens: 100}\nscaling: {minReplicaz: 2}\n",
            [":4: spec.scaling.minReplicaz: Extra inputs are not permitted"],
        ),
    ],
)
def test_simulate_with_a_bad_spec_exits_2_with_the_field_and_reason(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, needles: list[str]
) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    code, err = in_process(capsys, "simulate", AZURE, "--spec", spec, "--seeds", "1")
    assert code == 2 and err.startswith(f"headroom simulate: {spec}"), err
    assert all(n in err for n in needles), err


def test_simulate_of_a_bad_trace_exits_2_with_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    code, err = in_process(capsys, "simulate", trace, "--spec", spec_file(tmp_path / "chat.yaml"))
    assert code == 2 and "t.jsonl:1: 1 hash_ids for 600 tokens" in err, err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--quantiles", "0.3"], "--quantiles: 0.3 is outside [0.5, 0.99]"),
        (["--quantiles", "high"], "--quantiles must be numbers"),
        (["--seeds", "0"], "--seeds must be in [1, 100]"),
        (["--rate", "nan"], "--rate must be a positive number"),
        (["--rate", "1000"], "--rate must be at most 100"),
        (["--png", "/nonexistent-dir/x.png"], "--png: no directory /nonexistent-dir"),
    ],
)
def test_simulate_with_a_bad_argument_exits_2_before_replaying(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], needle: str
) -> None:
    spec = spec_file(tmp_path / "chat.yaml")
    code, err = in_process(capsys, "simulate", AZURE, "--spec", spec, "--progress", *args)
    assert code == 2 and needle in err and "requests from" not in err, err


def test_a_target_above_what_the_engine_admits_to_is_simulated_not_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The CRD takes a target of 0.97; the headroom engine admits only up to 95 % of a pool, so
    # the scaling loop caps it there (the operator must not fail on a spec the CRD accepted).
    trace = short_trace(tmp_path / "short.csv", minutes=3)
    spec = spec_file(tmp_path / "chat.yaml", targetOccupancy=0.97, scaleOutOccupancy=0.99)
    code, err = in_process(capsys, "simulate", trace, "--spec", spec, "--seeds", "1",
                           "--quantiles", "0.9")  # fmt: skip
    assert code == 0, err


@pytest.mark.parametrize(
    ("scaling", "named"),
    [
        ({"targetOccupancy": 0.5, "scaleOutOccupancy": 0.6},
         "(not the spec's targetOccupancy 0.5 and scaleOutOccupancy 0.6)"),
        ({"targetOccupancy": 0.95, "scaleOutOccupancy": 0.99},
         "(not the spec's scaleOutOccupancy 0.99)"),
        ({}, "(not the spec's default targetOccupancy 0.85 and default scaleOutOccupancy 0.95)"),
        ({"targetOccupancy": 0.95, "scaleOutOccupancy": 0.975}, None),
    ],
    ids=["both", "one", "defaults", "the-same"],
)  # fmt: skip
def test_simulate_names_the_spec_s_occupancy_settings_it_replaced(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    scaling: dict[str, float],
    named: str | None,
) -> None:
    """The sweep turns forecastQuantile alone, at the occupancy its band is sized for: the
    header names the spec's settings it did not use, stated or defaulted, and nothing when the
    spec asks for what was simulated."""
    trace = short_trace(tmp_path / "short.csv", minutes=3)
    spec = spec_file(tmp_path / "chat.yaml", **scaling)
    code = main(["simulate", str(trace), "--spec", str(spec), "--seeds", "1", "--quantiles", "0.9"])
    out = " ".join(capsys.readouterr().out.split())  # the header wraps
    assert code == 0
    assert "target occupancy 0.95 and scale-out line 0.975" in out
    if named is None:
        assert "not the spec's" not in out
    else:
        assert named in out


# ------------------------------------------------------------------------------------ progress


def test_progress_shows_on_stderr_with_the_flag_and_per_setting_and_seed(tmp_path: Path) -> None:
    trace = short_trace(tmp_path / "short.csv", minutes=3)
    r = headroom(
        "simulate",
        trace,
        "--spec",
        spec_file(tmp_path / "chat.yaml"),
        "--quantiles",
        "0.6,0.9",
        "--seeds",
        "2",
        "--progress",
    )
    assert r.returncode == 0, r.stderr
    assert "read " in r.stderr and "requests from short.csv" in r.stderr
    for i, (q, seed) in enumerate([(0.6, 1), (0.6, 2), (0.9, 1), (0.9, 2)], start=1):
        assert f"[{i}/4] forecastQuantile {q:.2f}, seed {seed}: " in r.stderr
    assert "\r" not in r.stderr  # not a terminal: plain lines
    p = headroom("profile", trace, "--progress")
    assert "read " in p.stderr and "profiled " in p.stderr


def test_progress_redraws_one_line_on_a_terminal_without_the_flag(tmp_path: Path) -> None:
    trace = short_trace(tmp_path / "short.csv", minutes=2)
    controller, terminal = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(controller, 4096)
            except OSError:  # the terminal side closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    proc = subprocess.run(
        [sys.executable, "-m", "headroom.contract.cli", "profile", str(trace)],
        stdout=subprocess.PIPE,
        stderr=terminal,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    os.close(terminal)
    reader.join(timeout=10)
    os.close(controller)
    shown = b"".join(chunks).decode()
    assert proc.returncode == 0
    assert "\r" in shown and "read " in shown and "profiled " in shown


# ------------------------------------------------------------------------------ missing extras


def test_without_numpy_profile_and_simulate_exit_2_naming_the_sim_extra(tmp_path: Path) -> None:
    trace = short_trace(tmp_path / "short.csv", minutes=1)
    for args in (["profile", str(trace)], ["simulate", str(trace), "--spec", str(EXAMPLE)]):
        code = (
            "import sys; sys.modules['numpy'] = None; from headroom.contract.cli import main; "
            f"raise SystemExit(main({args!r}))"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
        assert_clean_exit_2(r, "needs numpy", "pip install '.[sim]' in a headroom checkout")


def test_without_matplotlib_simulate_png_exits_2_before_any_replay(tmp_path: Path) -> None:
    trace = short_trace(tmp_path / "short.csv", minutes=1)
    args = [
        "simulate",
        str(trace),
        "--spec",
        str(EXAMPLE),
        "--png",
        str(tmp_path / "x.png"),
        "--progress",
    ]
    code = (
        "import sys; sys.modules['matplotlib'] = None; from headroom.contract.cli import main; "
        f"raise SystemExit(main({args!r}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert_clean_exit_2(r, "needs matplotlib", "pip install '.[sim]'")
    assert "forecastQuantile" not in r.stderr  # no replay ran


def test_the_cli_extras_are_pyproject_s_extras() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for name, modules in EXTRAS.items():
        dists = {d.split(">")[0].split("<")[0].split("=")[0].split("[")[0] for d in extras[name]}
        assert dists == set(modules), name


def test_a_missing_module_names_the_command_s_own_extra_else_the_smallest() -> None:
    assert extra_for("serve", "numpy") == "engine"
    assert extra_for("profile", "numpy") == "sim"
    assert extra_for("simulate", "matplotlib") == "sim"
    assert extra_for("plan", "matplotlib") == "sim"  # --plot: the smaller extra brings it
    assert extra_for("profile", "torch") == "engine"
    assert extra_for(None, "pydantic") is None


def test_the_parser_offers_the_formats_the_readers_read() -> None:
    # The parser keeps its own copy so that --help needs no numpy.
    from headroom.operator.simulate import cli, trace

    assert cli.FORMATS == trace.FORMATS


def test_profile_tables_max_is_never_below_its_p99(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # 100 requests at once at the opening, then one a second: the sizing's peak leaves the
    # opening out, the percentiles do not; the table's max is of the percentiles' series.
    rows = ["arrival_s,prompt_tokens,output_tokens"] + ["0,100,400"] * 100
    rows += [f"{t},100,400" for t in range(1, 600)]
    (tmp_path / "burst.csv").write_text("\n".join(rows) + "\n")
    assert main(["profile", str(tmp_path / "burst.csv")]) == 0
    out = capsys.readouterr().out
    for label in ("requests", "KV tokens"):
        (row,) = [ln for ln in out.splitlines() if ln.startswith(label + " ")]
        *pcts, top = (float(v.replace(",", "")) for v in row[len(label) :].split())
        assert top >= max(pcts), row


# ------------------------------------------------------------------------- small and odd inputs


def test_profile_of_a_trace_within_one_second_reports_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = "arrival_s,prompt_tokens,output_tokens\n0,100,10\n0.5,100,10\n"
    (tmp_path / "blink.csv").write_text(text)
    assert main(["profile", str(tmp_path / "blink.csv")]) == 0
    assert "the trace is shorter than one 1 s window" in capsys.readouterr().out


def test_profile_json_of_a_trace_at_one_instant_has_a_null_rate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "once.csv").write_text("arrival_s,prompt_tokens,output_tokens\n5,100,10\n5,90,10\n")
    assert main(["profile", str(tmp_path / "once.csv"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["duration"] == 0.0 and out["rate"] is None


def test_simulate_of_one_request_grades_the_step_it_arrives_in(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """All arrivals at one instant still make one graded step: the one pod it takes is the
    floor, and the pick costs the same."""
    (tmp_path / "one.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,10,10\n")
    code = main(["simulate", str(tmp_path / "one.csv"), "--spec", str(EXAMPLE), "--seeds", "1",
                 "--quantiles", "0.9"])  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "floor 0.00 GPU-hours" in out and "the pick costs 1.00x that" in out


@pytest.mark.parametrize(("suffix", "magic"), [(".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_simulate_draws_svg_and_pdf_the_same_every_time(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, suffix: str, magic: bytes
) -> None:
    (tmp_path / "few.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,10,10\n20,10,10\n")
    drawn = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}{suffix}"
        code = main(["simulate", str(tmp_path / "few.csv"), "--spec", str(EXAMPLE), "--seeds",
                     "1", "--quantiles", "0.9", "--png", str(out)])  # fmt: skip
        assert code == 0, capsys.readouterr().err
        drawn.append(out.read_bytes())
    assert drawn[0].startswith(magic) and drawn[0] == drawn[1]  # no date, no random ids
    assert b"Matplotlib v" not in drawn[0]


def test_profile_at_a_rate_reports_the_recorded_trace_s_ideal_hit_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The copies of a scaled trace share every prompt: their ratio would only grow with --rate.
    assert main(["profile", str(MOONCAKE), "--json"]) == 0
    once = json.loads(capsys.readouterr().out)["ideal_hit_ratio"]
    assert main(["profile", str(MOONCAKE), "--json", "--rate", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["ideal_hit_ratio"] == once
    assert main(["profile", str(MOONCAKE), "--rate", "3"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"ideal hit ratio {once:.1%} of prompt tokens" in text
    assert "an upper bound, of the trace as recorded" in text


def test_profile_for_a_model_caps_the_context_at_its_limit_as_a_spec_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The trace's p95 context is 48,910 tokens; mistral-7b takes 32,768 at most.
    code = main(["profile", str(MOONCAKE), "--model", "mistral-7b", "--gpu", "h100-80gb"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert pasted(captured.out)["traffic"]["contextTokens"] == 32768  # type: ignore[index]
    assert "capped at the engine's max length 32,768" in captured.out
    note = "engine.maxModelLen (it defaults to traffic.contextTokens, 32,768) refuses"
    assert note in captured.out


def test_profile_sizes_for_a_preset_the_headroom_engine_does_not_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--model sizes for a preset on its default path, 'tiny': gemma-2-9b, which only vLLM or
    SGLang load, is profiled rather than refused for its runtime."""
    code = main(["profile", str(MOONCAKE), "--model", "gemma-2-9b", "--gpu", "h100-80gb"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "gemma-2-9b on 1x h100-80gb" in captured.out
    assert pasted(captured.out)["traffic"]["peakConcurrency"] >= 1  # type: ignore[index]


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("deep.json", '{"a": ' * 100_000 + "1" + "}" * 100_000,
         "not JSON this reads: nested too deeply"),
        ("deep.yaml", "a: " + "[" * 5_000 + "]" * 5_000 + "\n",
         "not YAML this reads: nested too deeply"),
    ],
)  # fmt: skip
def test_simulate_with_a_spec_nested_too_deeply_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, text: str, needle: str
) -> None:
    spec = tmp_path / name
    spec.write_text(text)
    code, err = in_process(capsys, "simulate", AZURE, "--spec", spec, "--seeds", "1")
    assert code == 2 and err.startswith(f"headroom simulate: {spec}: {needle}"), err


def comments(text: str) -> str:
    """The text with its YAML comments' wrapping undone."""
    return " ".join(w for w in text.split() if w != "#")


L4_SPEC = (
    "apiVersion: headroom.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: chat-l4}\n"
    "spec:\n  model: {preset: llama-3.1-8b}\n  gpu: {type: l4-24gb}\n"
    "  traffic: {peakConcurrency: 128, contextTokens: 4136}\n"
    "  scaling: {minReplicas: 1, maxReplicas: 16, podStartSeconds: 120}\n"
)
# Mooncake's p95 context is 48,910 tokens; an L4 holds 25,904 of llama-3.1-8b's KV a pod.
L4_HOLDS = (
    "one 48910-token sequence needs 5.97 GiB of KV per GPU but only 3.16 GiB is left after "
    "weights 15.0 GiB and reserve 2.1 GiB; the headroom engine runs on one GPU: several GPUs per "
    "pod need engine.runtime vllm or sglang; this pod holds at most 25,904 tokens a sequence: a "
    "--spec with engine.maxModelLen: 25904 sizes for the requests up to it (it refuses 22.3% of "
    "these), else give the pod more GPU memory"
)


def test_profile_refuses_a_context_the_pod_cannot_hold_from_a_spec_as_from_a_model_and_gpu(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "chat-l4.yaml"
    spec.write_text(L4_SPEC)
    code, err = in_process(capsys, "profile", MOONCAKE, "--spec", spec)
    assert code == 2 and err == (
        f"headroom profile: {spec}: the trace's traffic.contextTokens 48910 does not fit: "
        f"{L4_HOLDS}\n"
    )
    code, err = in_process(
        capsys, "profile", MOONCAKE, "--model", "llama-3.1-8b", "--gpu", "l4-24gb"
    )
    assert code == 2 and err == (
        "headroom profile: --model llama-3.1-8b --gpu l4-24gb: the trace's traffic.contextTokens "
        f"48910 does not fit: {L4_HOLDS}\n"
    )
    # As it says: with that maxModelLen, the block it prints pasted in is a spec simulate takes.
    spec.write_text(L4_SPEC.replace("  traffic:", "  engine: {maxModelLen: 25904}\n  traffic:"))
    assert main(["profile", str(MOONCAKE), "--spec", str(spec)]) == 0
    out = capsys.readouterr().out
    doc = yaml.safe_load(spec.read_text())
    doc["spec"].update(pasted(out))
    spec.write_text(yaml.safe_dump(doc))
    sf = read_spec(spec)
    assert sf.spec.traffic.context_tokens == 25904 and sf.sizing.feasible
    assert "this pod's KV holds at most 25,904 tokens a sequence" in comments(out)


def test_profile_sizes_no_pod_for_the_requests_its_max_model_length_refuses(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # 20 requests of 9,001,000 tokens: llama-3.1-8b takes 131,072, so the engine refuses them
    # all and they hold no KV (not the 474 pods their KV would fill).
    trace = tmp_path / "huge.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n"
                     + "".join(f"{i},9000000,1000\n" for i in range(20)))  # fmt: skip
    code = main(["profile", str(trace), "--json", "--model", "llama-3.1-8b", "--gpu", "h100-80gb"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    pod = out["pod"]
    assert (pod["min_replicas"], pod["peak_replicas"], pod["max_replicas"]) == (1, 1, 2)
    assert "refuses 20 of these requests (100.0%" in comments(out["spec_yaml"])
    # The JSON says whose figures they are, as the text does: none of the 20 is in flight.
    assert (out["max_model_len"], out["refused_requests"]) == (131072, 20)
    assert out["peak_kv_tokens"] == out["tokens_per_request_in_flight"] == 0


def test_profile_json_figures_are_the_admitted_requests_as_in_the_text(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "chat-l4.yaml"
    spec.write_text(L4_SPEC.replace("  traffic:", "  engine: {maxModelLen: 25904}\n  traffic:"))
    assert main(["profile", str(MOONCAKE), "--spec", str(spec)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert main(["profile", str(MOONCAKE), "--spec", str(spec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_model_len"] == 25904 and out["refused_requests"] > 0
    held = round(out["tokens_per_request_in_flight"])
    assert f"those it admits hold {held:,} tokens on average" in text


def test_profile_says_the_weights_do_not_fit_not_the_context(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = in_process(capsys, "profile", AZURE, "--model", "llama-3.1-70b", "--gpu", "l4-24gb")
    assert code == 2 and err.startswith(
        "headroom profile: --model llama-3.1-70b --gpu l4-24gb: weights 131.4 GiB/GPU"
    )
    assert "contextTokens" not in err


# ----------------------------------------------------------------- the bounds of each argument


@pytest.mark.parametrize(
    ("command", "args", "needle"),
    [
        ("profile", ["--rate", "100"], None),
        ("profile", ["--rate", "0.5"], None),
        ("profile", ["--rate", "100.5"], "--rate must be at most 100, got 100.5"),
        ("profile", ["--decode-tps", "inf"], "--decode-tps must be a positive number, got inf"),
        ("profile", ["--block-size", "1"], None),
        ("profile", ["--block-size", "1024"], None),
        ("profile", ["--block-size", "1025"], "--block-size must be in [1, 1024], got 1025"),
        ("simulate", ["--seeds", "1"], None),
        ("simulate", ["--seeds", "100"], None),
        ("simulate", ["--seeds", "101"], "--seeds must be in [1, 100], got 101"),
        ("simulate", ["--rate", "100"], None),
        ("simulate", ["--rate", "101"], "--rate must be at most 100, got 101"),
        ("simulate", ["--quantiles", "0.5,0.99"], None),
    ],
)
def test_each_command_takes_each_bound_of_its_arguments_and_nothing_past_it(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    command: str,
    args: list[str],
    needle: str | None,
) -> None:
    """A value at a bound passes the checks and fails only on the spec, which is missing."""
    gone = tmp_path / "gone.yaml"
    code, err = in_process(capsys, command, AZURE, "--spec", gone, *args)
    assert code == 2 and err.startswith(f"headroom {command}: {needle or f'{gone}: cannot read'}")


def test_quantiles_are_distinct_and_ascending_from_0_5_to_0_99_inclusive() -> None:
    """scaling.forecastQuantile's range, both ends in it; repeats and blanks dropped."""
    assert quantiles("0.99, 0.5,,0.9,0.5") == (0.5, 0.9, 0.99)
    for text in ("0.49", "0.6,0.991"):
        with pytest.raises(UsageError, match=r"is outside \[0\.5, 0\.99\]"):
            quantiles(text)
    for text in ("", " , "):
        with pytest.raises(UsageError, match="needs at least one number"):
            quantiles(text)


def test_every_default_the_help_names_is_the_default_used_and_simulate_needs_a_spec() -> None:
    """`--help` is where a user reads the defaults: each `(default N)` must be the one used."""
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    add_parsers(subparsers)
    named = 0
    for sub in subparsers.choices.values():
        for action in sub._actions:
            said = re.search(r"\(default ([0-9.]+)\)", action.help or "")
            if said is not None:
                assert float(said[1]) == action.default, action.dest
                named += 1
    assert named == 5  # --rate twice, --decode-tps, --prefill-tps, --seeds
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["simulate", "t.csv"])
    assert info.value.code == 2


def test_a_report_that_cannot_be_written_exits_1_with_the_reason(tmp_path: Path) -> None:
    """The report is flushed as it is printed: a full disk is the command's error, not the
    interpreter's at exit."""
    trace = tmp_path / "blink.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,10\n0.5,100,10\n")
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "headroom.contract.cli", "profile", str(trace)],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            cwd=REPO,
        )
    assert r.returncode == 1
    assert (
        r.stderr
        == "headroom profile: cannot write the output: [Errno 28] No space left on device\n"
    )


def test_the_share_the_advised_max_model_length_refuses_admits_requests_of_its_length(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A maxModelLen admits a request exactly that long: of 90 requests of 25,904 tokens (what
    an L4 pod holds) and 10 of 60,000, the advised 25904 refuses the 10."""
    rows = [f"{i},{59_900 if i % 10 == 0 else 25_804},100" for i in range(100)]
    trace = tmp_path / "edge.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    code, err = in_process(capsys, "profile", trace, "--model", "llama-3.1-8b", "--gpu", "l4-24gb")
    assert code == 2 and "engine.maxModelLen: 25904 sizes" in err
    assert "(it refuses 10.0% of these)" in err, err
