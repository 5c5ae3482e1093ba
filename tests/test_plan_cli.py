"""`headroom plan` as a user runs it: table, JSON, chart and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from headroom.contract.cli import main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "headroom.contract.cli", "plan", *args],
        capture_output=True,
        text=True,
    )


BASE = [
    "--model",
    "llama-3.1-70b",
    "--gpu",
    "h100-80gb",
    "--tp",
    "4",
    "--concurrency",
    "128",
    "--context",
    "4096",
]


def test_table_names_every_figure() -> None:
    r = run(*BASE)
    assert r.returncode == 0, r.stderr
    for label in (
        "weights / GPU",
        "KV bytes / token",
        "KV for the peak",
        "KV capacity / pod",
        "sequences / pod",
        "replicas needed",
        "binding constraint",
        "with fp8 KV",
    ):
        assert label in r.stdout
    assert "327,680 B" in r.stdout and "160.0 GiB" in r.stdout


def test_capacity_counts_each_token_once_like_the_peak() -> None:
    # MLA keeps one latent on every rank: 8 GPUs hold 8 copies of each token. The row showed
    # the 8 pools' bytes (373.3 GiB) beside a peak counted once (34.3 GiB): 10x room that
    # is not there; the pod holds 87 sequences for a peak of 64.
    r = run("--model", "deepseek-v3", "--gpu", "h200-141gb", "--tp", "8",
            "--concurrency", "64", "--context", "8192")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "KV for the peak      34.3 GiB  (64 seq x 8,192 tokens)" in r.stdout
    assert "KV capacity / pod    46.7 GiB  (44,564 blocks of 16 = 713,024 tokens)" in r.stdout
    assert "sequences / pod      87 at 8,192 tokens" in r.stdout


def test_json_matches_the_library(capsys: object) -> None:
    assert main(["plan", *BASE, "--json", "--kv-dtype", "fp8", "--prefix-hit", "0.4"]) == 0
    out = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    assert out["kv_bytes_per_token"] == 163_840
    assert out["feasible"] is True and out["prefix_hit"] == 0.4
    assert out["replicas"] * out["sequences_per_pod"] >= 128


def test_plot_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "plan.png"
    r = run(*BASE, "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_model_and_gpu_exit_2_listing_names() -> None:
    r = run("--model", "llama-9", "--concurrency", "1", "--context", "10")
    assert r.returncode == 2 and "known models:" in r.stderr and "llama-3.1-8b" in r.stderr
    r = run("--model", "llama-3.1-8b", "--gpu", "tpu", "--concurrency", "1", "--context", "10")
    assert r.returncode == 2 and "known GPUs:" in r.stderr and "h200-141gb" in r.stderr


def test_bad_numbers_exit_2_naming_the_flag() -> None:
    r = run("--model", "llama-3.1-8b", "--concurrency", "0", "--context", "10")
    assert r.returncode == 2 and "--concurrency" in r.stderr
    r = run("--model", "llama-3.1-8b", "--concurrency", "1", "--context", "10", "--tp", "0")
    assert r.returncode == 2 and "--tp" in r.stderr
    r = run("--model", "llama-3.1-8b", "--concurrency", "1", "--context", "ten")
    assert r.returncode == 2 and "--context" in r.stderr
    r = run("--model", "llama-3.1-8b", "--concurrency", "1" + "0" * 20, "--context", "10")
    assert (
        r.returncode == 2
        and "--concurrency: Input should be less than or equal to 10000000" in r.stderr
    )


def test_gpu_memory_that_is_not_a_size_and_a_plot_nowhere_exit_2(tmp_path: Path) -> None:
    small = ["--model", "llama-3.1-8b", "--concurrency", "1", "--context", "10"]
    for value in ("inf", "nan", "-1", "5000"):
        r = run(*small, "--gpu-memory-gib", value)
        assert r.returncode == 2, (value, r.stderr)
        assert f"--gpu-memory-gib must be in [1, 4096], got {value}" in r.stderr.replace(".0", "")
    r = run(*small, "--plot", str(tmp_path / "nowhere" / "plan.png"))
    assert r.returncode == 2 and f"--plot: no directory {tmp_path / 'nowhere'}" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    r = run(*small, "--plot", str(tmp_path / "plan.txt"))  # matplotlib writes no .txt
    assert r.returncode == 2 and "must end in .png, .svg, .pdf" in r.stderr


def test_a_model_config_that_is_not_one_exits_2_naming_the_file(tmp_path: Path) -> None:
    cases = {"empty": {}, "list": [1], "zero-heads": {"num_attention_heads": 0, "hidden_size": 8,
             "num_hidden_layers": 1, "vocab_size": 4}}  # fmt: skip
    for name, doc in cases.items():
        cfg = tmp_path / f"{name}.json"
        cfg.write_text(json.dumps(doc))
        r = run("--model-config", str(cfg), "--concurrency", "1", "--context", "10")
        assert r.returncode == 2 and f"{cfg}:" in r.stderr, (name, r.stderr)
        assert "Traceback" not in r.stderr
    r = run("--model-config", str(cfg), "--params", "inf", "--concurrency", "1", "--context", "1")
    assert r.returncode == 2 and "--params must be billions" in r.stderr


def test_infeasible_plan_exits_1_with_the_reason() -> None:
    r = run("--model", "llama-3.1-405b", "--gpu", "h100", "--concurrency", "8", "--context", "4096")
    assert r.returncode == 1 and "INFEASIBLE" in r.stdout and "exceed" in r.stdout


def test_custom_gpu_memory() -> None:
    r = run(
        "--model",
        "llama-3.1-8b",
        "--gpu-memory-gib",
        "48",
        "--concurrency",
        "8",
        "--context",
        "4096",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["gpu"] == "48 GiB GPU"


def test_a_tp_the_stock_engines_refuse_exits_2() -> None:
    # The operator calls such a spec invalid (vLLM: "Total number of attention heads (32) must
    # be divisible by tensor parallel size (3)"); the planner used to size it.
    r = run("--model", "llama-3.1-8b", "--tp", "3", "--concurrency", "64", "--context", "4096")
    assert r.returncode == 2 and r.stdout == ""
    assert "--tp 3 does not divide llama-3.1-8b's 32 attention heads" in r.stderr


def test_weight_dtype_prices_the_weights_and_absurd_configs_exit_2(tmp_path: Path) -> None:
    def weights(*extra: str) -> int:
        r = run("--model", "llama-3.1-70b", "--concurrency", "1", "--context", "1024", "--json",
                *extra)  # fmt: skip
        return int(json.loads(r.stdout)["weights_bytes"])

    assert weights("--weight-dtype", "fp8") * 2 == weights()
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_attention_heads": 8, "hidden_size": 512, "vocab_size": 100,
                               "num_hidden_layers": 1e300}))  # fmt: skip
    r = run("--model-config", str(cfg), "--concurrency", "1", "--context", "10")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "num_layers: Input should be less than or equal to 1024" in r.stderr


def test_a_model_config_nested_too_deeply_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "deep.json"
    cfg.write_text("[" * 100_000 + "]" * 100_000)
    r = run("--model-config", str(cfg), "--concurrency", "1", "--context", "10")
    assert r.returncode == 2 and f"{cfg}: cannot read it as JSON: nested too deeply" in r.stderr
    assert "Traceback" not in r.stderr and "RecursionError" not in r.stderr
