"""`ListenConfig`'s ranges and immutability, and what `serve` opens before the model
loads: the stats listener (on the main host unless told, serving no API) and the lingering
time its listeners get; and `attach_engine` reading the chat template when not handed one."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any, cast

import pytest
from engine_process import free_port
from pydantic import ValidationError

from headroom.engine.async_engine import AsyncEngine
from headroom.engine.config import EngineConfig
from headroom.engine.server import runner
from headroom.engine.server.chat_template import serving_chat_template
from headroom.engine.server.runner import ListenConfig, attach_engine, serve
from headroom.engine.server.state import ServerSettings, ServerState


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_listen_config_accepts_the_edges_of_its_ranges() -> None:
    """The highest port, one connection, and timeouts under a second are all valid."""
    listen = ListenConfig(
        port=65535,
        stats_host="10.0.0.5",
        stats_port=65535,
        keepalive_timeout_s=0.5,
        header_timeout_s=0.5,
        send_timeout_s=0.5,
        max_connections=1,
    )
    assert listen.limits().max_connections == listen.stats_limits().max_connections == 1


@pytest.mark.parametrize(
    "bad",
    [{"port": 65536}, {"port": -1}, {"stats_port": 65536}, {"stats_port": -1},
     {"keepalive_timeout_s": 0}, {"header_timeout_s": 0}, {"send_timeout_s": 0},
     {"max_connections": 0}],
)  # fmt: skip
def test_listen_config_refuses_values_outside_its_ranges(bad: dict[str, int]) -> None:
    """A port past 65535, a zero timeout or a zero connection cap is a bad flag, not a bind."""
    with pytest.raises(ValidationError, match=next(iter(bad))):
        ListenConfig(**bad)


def test_a_stats_host_without_a_stats_port_is_refused_and_a_stats_port_alone_is_fine() -> None:
    """`--stats-host` alone would be silently ignored; `--stats-port` alone binds `--host`."""
    with pytest.raises(ValidationError, match="stats_host needs stats_port"):
        ListenConfig(stats_host="0.0.0.0")
    assert ListenConfig(port=8000, stats_port=9000).separate_stats


def test_listen_config_is_frozen() -> None:
    """Built once from the flags and shared by both listeners: it cannot change under them."""
    listen = ListenConfig()
    with pytest.raises(ValidationError):
        listen.port = 9000  # type: ignore[misc]


@asynccontextmanager
async def _serving_while_loading(
    monkeypatch: pytest.MonkeyPatch, listen: ListenConfig, settings: ServerSettings
) -> AsyncIterator[tuple[io.StringIO, list[dict[str, Any]]]]:
    """`serve` with a model load that never ends: its output and each listener's handler
    arguments; on exit it is stopped (during the load) and must return 0."""
    loading = threading.Event()
    release = threading.Event()

    def slow_build(config: EngineConfig) -> AsyncEngine:
        loading.set()
        release.wait()
        raise RuntimeError("load released by the test")

    handler_args: list[dict[str, Any]] = []
    real_listen = runner._listen

    async def recording_listen(*args: Any) -> Any:
        handler_args.append(args[-1])
        return await real_listen(*args)

    monkeypatch.setattr(runner, "build_engine", slow_build)
    monkeypatch.setattr(runner, "_listen", recording_listen)
    stop = asyncio.Event()
    out = io.StringIO()
    left_behind: list[threading.Thread] = []
    task = asyncio.ensure_future(
        serve(EngineConfig(model="tiny"), settings, listen, stop=stop, out=out,
              left_behind=left_behind)
    )  # fmt: skip
    try:
        await asyncio.to_thread(loading.wait, 10)
        yield out, handler_args
        stop.set()
        assert await asyncio.wait_for(task, 10) == 0
    finally:
        release.set()
        task.cancel()
        for t in left_behind:
            t.join(10)


async def test_a_stats_listener_binds_the_main_host_and_serves_no_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without `--stats-host` the stats listener is on `--host`, and `/v1/*` is not there
    (it is open, with no bearer check: only /health /ready /stats may be on it)."""
    port, sport = free_port(), free_port()
    listen = ListenConfig(host="127.0.0.1", port=port, stats_port=sport)
    settings = ServerSettings(served_model_name="tiny")
    async with _serving_while_loading(monkeypatch, listen, settings) as (out, _):
        assert f"/health /ready /stats on http://127.0.0.1:{sport}" in out.getvalue()
        # The API's port is bound before the load: the line must not read as ready.
        assert f"listening on http://127.0.0.1:{port}, loading the model" in out.getvalue()
        status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{sport}/ready")
        assert (status, body["reason"]) == (503, "loading")
        status, _ = await asyncio.to_thread(_get, f"http://127.0.0.1:{sport}/v1/models")
        assert status == 404
        status, _ = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/v1/models")
        assert status == 503  # the main listener has the API, not ready yet


@pytest.mark.parametrize(("body_timeout_s", "linger"), [(30.0, 10.0), (3.0, 3.0)])
async def test_an_unread_body_is_drained_for_at_most_10s_or_the_body_timeout(
    monkeypatch: pytest.MonkeyPatch, body_timeout_s: float, linger: float
) -> None:
    """aiohttp's lingering time, on both listeners: a client gets no longer than for a body."""
    listen = ListenConfig(port=free_port(), stats_port=free_port())
    settings = ServerSettings(served_model_name="tiny", body_timeout_s=body_timeout_s)
    async with _serving_while_loading(monkeypatch, listen, settings) as (_, handler_args):
        assert [a["lingering_time"] for a in handler_args] == [linger, linger]


def test_attach_engine_reads_the_model_s_chat_template_when_not_given_one() -> None:
    """Tests and tools attach an engine without a template: chat must still have the model's."""
    state = ServerState(ServerSettings(served_model_name="tiny"))
    engine = cast(AsyncEngine, SimpleNamespace(tokenizer=object()))
    template = attach_engine(state, engine, "tiny", 512)
    assert template is state.chat_template
    assert template.source == serving_chat_template("tiny").source
    assert (state.engine, state.tokenizer, state.max_model_len) == (engine, engine.tokenizer, 512)


async def test_a_checkpoint_that_fails_to_load_exits_1_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A parser's error in the load is exit 1 (a broken model, not a bad flag), said in one
    line naming it, and the listener is closed."""

    def broken_build(config: EngineConfig) -> AsyncEngine:
        raise KeyError("model.embed_tokens.weight")

    monkeypatch.setattr(runner, "build_engine", broken_build)
    port = free_port()
    listen = ListenConfig(port=port)
    settings = ServerSettings(served_model_name="tiny")
    code = await serve(EngineConfig(model="tiny"), settings, listen, out=io.StringIO())
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err == "headroom serve: model failed to load: KeyError: 'model.embed_tokens.weight'"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
