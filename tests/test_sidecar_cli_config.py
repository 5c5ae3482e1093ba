"""The sidecar's flags and config: defaults, each bound's edge, the key's characters, freshness,
exit codes, and the wait for a draining engine's port to close."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import socket
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from headroom.contract.ports import SIDECAR_PORT
from headroom.sidecar.__main__ import main as sidecar_main
from headroom.sidecar.cli import (
    config_from_args,
    configure_parser,
    engine_listening,
    stop_when_engine_exits,
)
from headroom.sidecar.config import API_KEY_ENV, IdentityLabels, SidecarConfig

pytestmark = pytest.mark.timeout(60)

URL = "http://127.0.0.1:8000"
ENV = (API_KEY_ENV, "POD_NAME", "POD_NAMESPACE", "HEADROOM_INFERENCEDEPLOYMENT")


def _from_flags(*flags: str) -> SidecarConfig:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return config_from_args(parser.parse_args(["--engine-url", URL, *flags]))


def test_the_flags_defaults_are_the_configs_documented_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No flag given: the documented defaults, the same from the CLI as from the model."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    cfg = _from_flags()
    assert cfg == SidecarConfig(engine_url=URL)
    assert (cfg.source, cfg.host, cfg.port, cfg.page_size, cfg.planned_blocks) == (
        "headroom", "0.0.0.0", SIDECAR_PORT, 1, None,
    )  # fmt: skip
    assert (cfg.interval, cfg.timeout, cfg.window, cfg.forecast_window) == (1.0, 0.8, 60.0, 30.0)
    assert (cfg.min_forecast_points, cfg.shutdown_wait, cfg.api_key) == (3, 0.0, None)


# Wide windows, so that each case tests its one bound and not a rule across fields.
WIDE: dict[str, Any] = {"engine_url": URL, "window": 86400.0, "forecast_window": 86400.0}


@pytest.mark.parametrize(
    "edge",
    [
        {"port": 0},
        {"port": 65535},
        {"page_size": 1},
        {"planned_blocks": 1},
        {"interval": 3600.0},
        {"min_forecast_points": 2},
        {"shutdown_wait": 0.0},
        # The rules across fields hold at equality: a window of exactly one interval, a
        # forecast window of exactly the polls it needs, a timeout of the whole interval.
        {"window": 2.0, "interval": 2.0, "timeout": 2.0, "forecast_window": 4.0},
        {"interval": 1.5, "timeout": 0.5, "min_forecast_points": 5, "forecast_window": 6.0},
    ],
)
def test_each_bound_admits_its_edge(edge: dict[str, Any]) -> None:
    """Every documented limit is inclusive: the edge value itself is a valid config."""
    cfg = SidecarConfig(**{**WIDE, **edge})
    assert all(getattr(cfg, k) == v for k, v in edge.items())


@pytest.mark.parametrize(
    ("past", "complaint"),
    [
        ({"port": -1}, "port"),
        ({"port": 65536}, "port"),
        ({"page_size": 0}, "page_size"),
        ({"planned_blocks": 0}, "planned_blocks"),
        ({"interval": 0.0}, "interval"),
        ({"interval": 3600.5}, "interval"),
        ({"timeout": 0.0}, "timeout"),
        ({"window": 86400.5}, "window"),
        ({"forecast_window": 86400.5}, "forecast_window"),
        ({"min_forecast_points": 1}, "min_forecast_points"),
        ({"shutdown_wait": -0.5}, "shutdown_wait"),
        # Endless: the window would keep every sample; the wait, a sidecar whose engine stays.
        ({"forecast_window": math.inf}, "finite"),
        ({"shutdown_wait": math.inf}, "finite"),
        ({"window": 1.5, "interval": 2.0, "timeout": 1.0}, "must hold at least one interval"),
        ({"interval": 1.5, "timeout": 0.5, "forecast_window": 2.5}, "must hold 3 polls"),
        ({"interval": 1.0, "timeout": 1.5}, "must not exceed interval"),
    ],
)
def test_a_value_past_its_bound_is_refused(past: dict[str, Any], complaint: str) -> None:
    """One step past each limit fails, naming the field or the rule it breaks."""
    with pytest.raises(ValidationError, match=complaint):
        SidecarConfig(**{**WIDE, **past})


@pytest.mark.parametrize("key", ["s3cret", "a b", "~!é"])
def test_a_key_of_printable_characters_is_kept(key: str) -> None:
    """A space, `~` (126) and non-ASCII can all go in a header: only controls are refused."""
    cfg = SidecarConfig(engine_url=URL, api_key=key)  # type: ignore[arg-type]
    assert cfg.api_key is not None and cfg.api_key.get_secret_value() == key


@pytest.mark.parametrize("key", ["a\x1fb", "a\x7fb", "\x00", "ab\n"])
def test_a_key_with_a_control_character_is_refused(key: str) -> None:
    """Every C0 control and DEL: no HTTP header can carry them."""
    with pytest.raises(ValidationError, match="control character"):
        SidecarConfig(engine_url=URL, api_key=key)  # type: ignore[arg-type]


def test_a_reading_stays_fresh_through_one_failed_poll() -> None:
    """Fresh for two intervals plus one poll's timeout: the next poll may fail and the one
    after may run to its deadline before the last good reading goes stale."""
    cfg = SidecarConfig(engine_url=URL, interval=2.0, timeout=0.5)
    assert cfg.stale_after == 4.5


def test_the_engine_url_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    """No engine to poll is a usage error from argparse, before any validation."""
    with pytest.raises(SystemExit) as exc:
        sidecar_main([])
    assert exc.value.code == 2
    assert "the following arguments are required: --engine-url" in capsys.readouterr().err


def test_an_unknown_log_level_is_a_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything listens, with the usage exit code."""
    assert sidecar_main(["--engine-url", URL, "--log-level", "chatty"]) == 2
    assert "unknown --log-level 'chatty'" in capsys.readouterr().err


def test_a_port_already_taken_exits_1(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Not a bad flag but a failure to start: exit 1, naming the address, and that alone: it
    does not poll the engine first (an engine_down there would send the reader to the engine)."""
    with socket.socket() as taken, caplog.at_level(logging.DEBUG):
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = sidecar_main(["--engine-url", URL, "--host", "127.0.0.1", "--port", str(port)])
    assert code == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert not [r for r in caplog.records if "engine_" in r.getMessage()]


def test_a_host_that_does_not_resolve_is_a_bad_flag(
    unresolvable_host: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unresolvable --host is the user's typo (exit 2), not a failure to start (exit 1)."""
    assert sidecar_main(["--engine-url", URL, "--host", unresolvable_host, "--port", "0"]) == 2
    assert f"--host {unresolvable_host}: " in capsys.readouterr().err


def test_a_validated_config_cannot_be_changed() -> None:
    """Validated once, at start: a field set afterwards would skip the rules across fields."""
    cfg = SidecarConfig(engine_url=URL, labels=IdentityLabels(pod="p-0"))
    with pytest.raises(ValidationError, match="frozen"):
        cfg.timeout = 5.0  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        cfg.labels.pod = "p-1"  # type: ignore[misc]
    assert (cfg.timeout, cfg.labels.pod) == (0.8, "p-0")


async def _until(cond: Callable[[], bool], what: str, within: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"not within {within:g} s: {what}"
        await asyncio.sleep(0.005)


async def _engine_port(accepted: list[int]) -> asyncio.Server:
    """A port that accepts and counts connections, as a draining engine's still does."""

    def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.close()

    return await asyncio.start_server(accept, "127.0.0.1", 0)


@pytest.mark.parametrize(
    ("url", "port"),
    [("http://engine", 80), ("https://engine/", 443), ("https://engine:8443/stats", 8443)],
)
async def test_an_engine_url_without_a_port_is_probed_at_its_schemes_port(
    url: str, port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port the poller reaches the engine at: the URL's own, else the scheme's."""
    probed: list[tuple[str, int]] = []

    async def refuse(host: str, port: int) -> None:
        probed.append((host, port))
        raise ConnectionRefusedError

    monkeypatch.setattr(asyncio, "open_connection", refuse)
    assert not await engine_listening(url, 1.0)
    assert probed == [("engine", port)]


async def test_a_probe_with_no_answer_counts_as_the_engine_still_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No answer in time (a full listen queue) is no proof the engine has gone: keep serving."""

    async def unanswered(host: str, port: int) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(asyncio, "open_connection", unanswered)
    assert await engine_listening("http://engine:8000", 0.01)


async def test_the_wait_ends_at_once_for_an_engine_already_gone() -> None:
    """A refused connection is the engine gone: stop, however long the wait allowed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    stop = asyncio.Event()
    await asyncio.wait_for(
        stop_when_engine_exits(f"http://127.0.0.1:{port}", 600.0, 60.0, 1.0, stop), 10.0
    )
    assert stop.is_set()


async def test_the_sidecar_serves_on_until_the_engine_stops_listening(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While the port accepts, the wait goes on, probing each interval (and saying so once);
    it ends once the port refuses, long before `wait_s`."""
    caplog.set_level(logging.INFO, logger="headroom.sidecar")
    accepted: list[int] = []
    server = await _engine_port(accepted)
    port = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    waiting = asyncio.create_task(
        stop_when_engine_exits(f"http://127.0.0.1:{port}", 600.0, 0.01, 1.0, stop)
    )
    await _until(lambda: len(accepted) >= 3, "three probes of a listening engine")
    assert not stop.is_set() and not waiting.done()
    server.close()
    await server.wait_closed()
    await asyncio.wait_for(waiting, 10.0)
    assert stop.is_set()
    events = [r.getMessage().split()[0] for r in caplog.records]
    assert events == ["event=shutdown_wait", "event=engine_gone"]


async def test_the_wait_runs_out_after_wait_s_though_the_engine_listens() -> None:
    """An engine that never exits holds the sidecar `wait_s`, not a whole (longer) interval,
    and is probed again at the end before the sidecar gives up."""
    accepted: list[int] = []
    async with await _engine_port(accepted) as server:
        port = server.sockets[0].getsockname()[1]
        stop = asyncio.Event()
        await asyncio.wait_for(
            stop_when_engine_exits(f"http://127.0.0.1:{port}", 0.3, 60.0, 1.0, stop), 10.0
        )
        assert stop.is_set()
        await _until(lambda: len(accepted) >= 2, "a probe at the start and one at the end")
