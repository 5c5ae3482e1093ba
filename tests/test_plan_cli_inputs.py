"""`headroom plan` inputs a user can get wrong, and a reader that stops early."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import headroom.contract.plan_cli as plan_cli
from headroom.contract.budget import PlanInput, from_hf_config, model_preset, plan
from headroom.contract.cli import main

SMALL = ["--model", "llama-3.1-8b", "--concurrency", "1", "--context", "100"]
# A Llama 3.1 8B config.json: 8.0e9 parameters by the estimate.
LLAMA_8B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
            "vocab_size": 128256, "max_position_embeddings": 131072}  # fmt: skip
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768,
        "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257}  # fmt: skip


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "headroom.contract.cli", "plan", *args],
        capture_output=True,
        text=True,
    )


def write_config(tmp_path: Path, name: str, cfg: dict[str, object]) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def test_a_reader_that_closes_stdout_ends_the_command_quietly() -> None:
    read, write = os.pipe()
    os.close(read)  # every write to `write` now fails with EPIPE, with no race against a reader
    try:
        r = subprocess.run(
            [sys.executable, "-m", "headroom.contract.cli", "plan", *SMALL],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (0, "")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", [["plan", *SMALL, "--json"], ["crd"]])
def test_an_output_that_cannot_be_written_is_one_line_not_a_traceback(command: list[str]) -> None:
    # stdout on a full disk raised OSError ENOSPC: a 10-line traceback instead of the reason.
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "headroom.contract.cli", *command],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
        )
    assert r.returncode == 1
    assert r.stderr == (
        f"headroom {command[0]}: cannot write the output: [Errno 28] No space left on device\n"
    )


def test_a_broken_pipe_that_is_not_stdout_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    # A server's client socket breaking is a failure, not a reader that stopped reading.
    def broken(args: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(plan_cli, "run", broken)
    with pytest.raises(BrokenPipeError):
        main(["plan", *SMALL])


@pytest.mark.parametrize("gib", ["1e-12", "1e-9", "0.5", "4097"])
def test_gpu_memory_outside_the_crd_bounds_exits_2_naming_the_flag(gib: str) -> None:
    r = run(*SMALL, "--gpu-memory-gib", gib)
    assert r.returncode == 2 and r.stdout == ""
    assert f"--gpu-memory-gib must be in [1, 4096], got {float(gib)}" in r.stderr


def test_gpu_memory_bytes_errors_name_the_gib_flag() -> None:
    # No --gpu-memory-bytes flag exists: the bytes come from --gpu-memory-gib.
    with pytest.raises(ValidationError) as err:
        PlanInput(model=model_preset("llama-3.1-8b"), gpu_memory_bytes=0, concurrency=1,
                  context=1)  # fmt: skip
    assert plan_cli._validation_message(err.value).startswith("--gpu-memory-gib: ")


def test_a_tp_that_does_not_divide_the_pod_names_both_flags() -> None:
    r = run(*SMALL, "--tp", "2", "--gpus-per-pod", "1")
    assert r.returncode == 2 and r.stdout == ""
    assert "headroom plan: --tp 2 does not divide --gpus-per-pod 1" in r.stderr
    assert "Value error" not in r.stderr and "--input" not in r.stderr


def test_a_params_below_one_parameter_exits_2_naming_params(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "llama", LLAMA_8B)
    r = run("--model-config", str(cfg), "--concurrency", "1", "--context", "100",
            "--params", "1e-10")  # fmt: skip
    assert r.returncode == 2
    assert "--params must be at least 1e-09 billion (one parameter), got 1e-10" in r.stderr
    assert "num_parameters" not in r.stderr


def test_params_with_a_preset_exits_2_naming_params() -> None:
    r = run(*SMALL, "--params", "70")
    assert r.returncode == 2 and r.stdout == ""
    assert "--params goes with --model-config" in r.stderr


def test_a_gpt2_config_is_bounded_by_n_positions(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "gpt2", GPT2)
    assert from_hf_config(cfg).max_position_embeddings == 1024
    r = run("--model-config", str(cfg), "--concurrency", "1", "--context", "2000")
    assert r.returncode == 1 and "'s max_position_embeddings 1024" in r.stdout


def test_an_fp32_checkpoint_is_priced_at_the_16_bits_vllm_serves(tmp_path: Path) -> None:
    def weights(cfg: dict[str, object], *extra: str) -> int:
        path = write_config(tmp_path, "llama", cfg)
        r = run("--model-config", str(path), "--concurrency", "1", "--context", "100", "--json",
                *extra)  # fmt: skip
        assert r.returncode == 0, r.stderr
        return int(json.loads(r.stdout)["weights_bytes"])

    bf16 = weights({**LLAMA_8B, "torch_dtype": "bfloat16"})
    assert weights({**LLAMA_8B, "torch_dtype": "float32"}) == bf16
    # Stated outright, fp32 is what the user gets: 4 bytes a weight.
    assert weights({**LLAMA_8B, "torch_dtype": "float32"}, "--weight-dtype", "fp32") == 2 * bf16


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="headroom")
    plan_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["plan", *argv])


@pytest.mark.parametrize(
    ("drop", "said"),
    [
        ("--model", "one of the arguments --model --model-config is required"),
        ("--concurrency", "the following arguments are required: --concurrency"),
        ("--context", "the following arguments are required: --context"),
    ],
)
def test_a_plan_without_a_model_or_a_peak_exits_2_saying_it_is_required(
    drop: str, said: str
) -> None:
    """argparse names the missing flag; a default of None would reach the planner instead."""
    at = SMALL.index(drop)
    r = run(*SMALL[:at], *SMALL[at + 2 :])
    assert r.returncode == 2 and r.stdout == ""
    assert said in r.stderr


@pytest.mark.parametrize("gib", ["1", "48.5", "4096"])
def test_gpu_memory_at_and_within_the_crd_bounds_is_that_many_gib(gib: str) -> None:
    """The bounds are inclusive, as gpu.memoryGiB's are, and a GiB is 2**30 bytes."""
    inp = plan_cli.build_input(parse(*SMALL, "--gpu-memory-gib", gib))
    assert inp.gpu_memory_bytes == int(float(gib) * 2**30)
    assert inp.gpu_name == f"{float(gib):g} GiB GPU"


@pytest.mark.parametrize(
    ("billions", "count"), [("8", 8_000_000_000), ("1e6", 10**15), ("1e-9", 1)]
)
def test_params_is_a_count_in_billions_up_to_the_arch_bound(
    tmp_path: Path, billions: str, count: int
) -> None:
    """--params 8 is 8e9 parameters; 1e6 billion (the bound) and one parameter are both taken."""
    cfg = write_config(tmp_path, "llama", LLAMA_8B)
    args = parse("--model-config", str(cfg), "--concurrency", "1", "--context", "100",
                 "--params", billions)  # fmt: skip
    assert plan_cli.build_input(args).model.num_parameters == count


def test_zero_params_is_outside_the_range_not_below_one_parameter() -> None:
    """0 fails the (0, 1e6] range check itself, with the message that names the range."""
    with pytest.raises(ValueError, match=r"--params must be billions in \(0, 1e6\], got 0.0"):
        plan_cli._parameter_count(0.0)


@pytest.mark.parametrize(
    ("tp", "gpus", "flag"),
    [
        ("0", "2", "--tp"),
        ("-1", "2", "--tp"),
        ("2", "0", "--gpus-per-pod"),
        ("2", "-1", "--gpus-per-pod"),
    ],
)
def test_a_tp_or_pod_size_below_one_exits_2_naming_the_flag(tp: str, gpus: str, flag: str) -> None:
    """The pod-split check leaves these to the bound checks: never a modulo by zero."""
    r = run(*SMALL, "--tp", tp, "--gpus-per-pod", gpus)
    assert r.returncode == 2 and r.stdout == ""
    assert f"headroom plan: {flag}: " in r.stderr and "Traceback" not in r.stderr


def test_the_table_gives_the_weights_in_gib_and_in_decimal_gb() -> None:
    """Model cards quote decimal GB: llama-3.1-8b's 16,060,522,496 bytes are 15.0 GiB = 16.1 GB."""
    table = plan_cli.render_plan(plan(plan_cli.build_input(parse(*SMALL))))
    assert "15.0 GiB  (total 15.0 GiB = 16.1 GB)" in table
