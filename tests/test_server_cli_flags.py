"""Bad `headroom serve` flags exit 2 naming the flag, before any port is bound or model loaded:
the stats listener on the main port, and a step timeout that is not a positive number. Also
the flags' defaults and units, the served name and key, and the exit codes of a taken port
and an unresolvable host."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest
from engine_process import free_port
from pydantic import ValidationError

from headroom.engine.config import EngineConfig
from headroom.engine.server.auth import API_KEY_ENV
from headroom.engine.server.cli import add_arguments, build_configs, parse_bytes
from headroom.engine.server.cli import main as server_main
from headroom.engine.server.runner import ListenConfig
from headroom.engine.server.state import ServerSettings


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


def _configs(*argv: str) -> tuple[EngineConfig, ServerSettings, ListenConfig]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_configs(parser.parse_args(list(argv)))


def test_the_flag_defaults_are_the_configs_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """`headroom serve` with no flags runs the configs built in code (and sized by plan)."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    engine, settings, listen = _configs()
    assert engine == EngineConfig()
    assert settings == ServerSettings(served_model_name="tiny")
    assert listen == ListenConfig()


@pytest.mark.parametrize(
    ("text", "size"),
    [("1", 1), ("1b", 1), ("2 K", 2_000), ("2kb", 2_000), ("3M", 3_000_000), ("3MB", 3_000_000),
     ("4g", 4_000_000_000), ("4GB", 4_000_000_000), ("1KiB", 1024), ("2MiB", 2 * 2**20),
     ("1.5gib", 3 * 2**29), ("1TiB", 2**40), ("1.5e9", 1_500_000_000)],
)  # fmt: skip
def test_sizes_take_every_unit_the_help_names(text: str, size: int) -> None:
    """Decimal K/M/G (with or without B), binary KiB..TiB, in any case, with or without a space."""
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["0", "0.5", "0GiB", "0.0001K"])
def test_a_size_under_one_byte_is_refused(text: str) -> None:
    """The smallest size is one byte: a pool or body cap of 0 is a bad flag, not "none"."""
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1 byte"):
        parse_bytes(text)


def test_the_served_name_is_the_flag_else_the_model_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients ask for the model directory's name (a trailing slash aside, `.` too; the root's
    is its path, not an empty name refused as a flag never given) unless renamed."""
    model = tmp_path / "my-model"
    assert _configs("--model", f"{model}/")[1].served_model_name == "my-model"
    model.mkdir()
    monkeypatch.chdir(model)
    assert _configs("--model", ".")[1].served_model_name == "my-model"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _configs("--model", "~/my-model/")[1].served_model_name == "my-model"
    assert _configs("--model", str(model), "--served-model-name", "m")[1].served_model_name == "m"
    assert _configs("--served-model-name", "m")[1].served_model_name == "m"
    assert _configs()[1].served_model_name == "tiny"
    assert _configs("--model", "/")[1].served_model_name == "/"


def test_the_api_key_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """--api-key, else HEADROOM_API_KEY, else no auth (an empty variable is no key)."""
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _configs("--api-key", "from-flag")[1].api_key == "from-flag"
    assert _configs()[1].api_key == "from-env"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert _configs()[1].api_key is None


def test_a_port_in_use_exits_1_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    """A taken port is an environment failure (exit 1), said in one line, not a traceback."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert server_main(["--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert "headroom serve:" in err and "Traceback" not in err


def test_a_host_that_does_not_resolve_is_a_bad_flag(
    unresolvable_host: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unresolvable --host exits 2 naming the flag."""
    assert server_main(["--host", unresolvable_host, "--port", str(free_port())]) == 2
    assert f"--host/--stats-host {unresolvable_host}:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "size"),
    [("4.1G", 4_100_000_000), ("4.1GB", 4_100_000_000), ("64.1M", 64_100_000),
     ("1.001K", 1_001), ("0.5KiB", 512), ("2.5e3", 2_500)],
)  # fmt: skip
def test_a_decimal_size_is_exact(text: str, size: int) -> None:
    """A size a unit makes whole is that many bytes: in floats 4.1G was a byte short."""
    assert parse_bytes(text) == size


@pytest.mark.parametrize(
    ("text", "complaint"),
    [("0e9999999", "at least 1 byte"), ("1e9999999", "not a finite number"),
     ("1" * 65, "too many digits"), ("0." + "0" * 70 + "1", "too many digits")],
)  # fmt: skip
def test_a_size_is_refused_before_it_is_expensive(text: str, complaint: str) -> None:
    """An exponent or a digit string no size needs is refused at once with its reason, not
    computed exactly (10**9999999) or left to int conversion's 4,300-digit limit."""
    with pytest.raises(argparse.ArgumentTypeError, match=complaint):
        parse_bytes(text)
