"""Bad `headroom serve` flags exit 2 naming the flag, before any port is bound or model loaded:
the stats listener on the main port, and a step timeout that is not a positive number."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_process import free_port
from pydantic import ValidationError

from headroom.engine.server.cli import main as server_main
from headroom.engine.server.runner import ListenConfig


def test_a_stats_port_equal_to_the_port_is_a_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    port = str(free_port())
    assert server_main(["--port", port, "--stats-port", port]) == 2
    err = capsys.readouterr().err
    assert f"--stats-port {port} is also --port" in err
    assert "Address already in use" not in err


@pytest.mark.parametrize(
    ("host", "stats_host"),
    [("127.0.0.1", None), ("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"),
     ("127.0.0.1", "::")],
)  # fmt: skip
def test_one_port_for_both_listeners_on_overlapping_addresses_is_refused(
    host: str, stats_host: str | None
) -> None:
    with pytest.raises(ValidationError, match="stats_port 8000 is also --port"):
        ListenConfig(host=host, port=8000, stats_host=stats_host, stats_port=8000)


def test_one_port_on_two_distinct_addresses_and_two_picked_ports_are_fine() -> None:
    ListenConfig(host="127.0.0.1", port=8000, stats_host="10.0.0.5", stats_port=8000)
    ListenConfig(port=0, stats_port=0)  # each listener picks its own free port


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_step_timeout_must_be_a_positive_number(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert server_main(["--port", str(free_port()), "--step-timeout", value]) == 2
    assert "--step-timeout:" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_send_timeout_must_be_a_positive_number(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert server_main(["--port", str(free_port()), "--send-timeout", value]) == 2
    assert "--send-timeout:" in capsys.readouterr().err


def test_the_send_timeout_reaches_every_listener() -> None:
    import argparse

    from headroom.engine.server.cli import add_arguments, build_configs

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--send-timeout", "7.5", "--stats-port", "0"])
    listen = build_configs(args)[2]
    assert listen.limits().send_timeout_s == 7.5


def test_an_unreadable_tokenizer_config_exits_2_before_the_weights_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The directory has no weights: read after the load, it would fail there (exit 1, "model
    # failed to load"); it used to crash with a traceback once the engine had started.
    config = tmp_path / "tokenizer_config.json"
    for text, says in [("{oops", "not valid JSON"), ("[]", "expected a JSON object, got list")]:
        config.write_text(text)
        assert server_main(["--model", str(tmp_path), "--port", str(free_port())]) == 2
        err = capsys.readouterr().err.strip()
        assert err == err.splitlines()[-1] and f"--model: {config}: {says}" in err, err
        assert "model failed to load" not in err and "Traceback" not in err


def test_a_model_path_with_a_tilde_is_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--model '~/m'` (quoted, so the shell leaves the ~) was refused as "no directory".
    monkeypatch.setenv("HOME", str(tmp_path))
    model = tmp_path / "m"
    model.mkdir()
    (model / "tokenizer_config.json").write_text("[]")  # stops it before any load
    assert server_main(["--model", "~/m", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "no directory" not in err and f"{model / 'tokenizer_config.json'}: expected" in err, err
