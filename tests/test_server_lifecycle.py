"""Server life cycle against real subprocesses: bearer auth and the open stats listener, a
client disconnect freeing its blocks, SIGTERM draining (and its 503 ending a kept-alive
connection, so a retry reconnects), and the fail-fast pool check."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest
from engine_process import ServerProcess, free_port, held_stream

from headroom.engine.server.cli import main as server_main
from headroom.engine.server.cli import parse_bytes

KEY = "s3cret-key"


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_for(cond: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


@pytest.fixture(scope="module")
def secured() -> Iterator[ServerProcess]:
    stats_port = free_port()
    with ServerProcess(
        "--model", "tiny", "--max-model-len", "2048", "--num-blocks", "512",
        "--no-enable-prefix-caching", "--stats-host", "127.0.0.1",
        "--stats-port", str(stats_port), env={"HEADROOM_API_KEY": KEY},
    ) as srv:  # fmt: skip
        srv.stats_url = f"http://127.0.0.1:{stats_port}"  # type: ignore[attr-defined]
        yield srv


def test_bearer_auth_guards_v1_only(secured: ServerProcess) -> None:
    bad = openai.OpenAI(base_url=secured.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key") as info:
        bad.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, body = _get(secured.url + "/v1/models")
    assert status == 401 and "missing API key" in body["error"]["message"]
    good = openai.OpenAI(base_url=secured.url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="tiny", prompt="x", max_tokens=2).usage is not None
    # Probes and the sidecar need no key, on the main and on the stats listener.
    for base in (secured.url, secured.stats_url):  # type: ignore[attr-defined]
        assert _get(base + "/health")[0] == 200
        assert _get(base + "/ready")[0] == 200
        assert _get(base + "/stats")[0] == 200
    # The stats listener serves nothing else.
    assert _get(secured.stats_url + "/v1/models", {"Authorization": f"Bearer {KEY}"})[0] == 404  # type: ignore[attr-defined]


def test_client_disconnect_mid_stream_frees_its_blocks(secured: ServerProcess) -> None:
    stats_url = secured.stats_url + "/stats"  # type: ignore[attr-defined]
    before = _get(stats_url)[1]
    assert before["requests"]["running"] == 0
    client = openai.OpenAI(base_url=secured.url + "/v1", api_key=KEY, max_retries=0)
    stream = client.completions.create(
        model="tiny", prompt="p" * 300, max_tokens=1500, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    got = 0
    for chunk in stream:
        got += 1 if chunk.choices and chunk.choices[0].text else 0
        if got >= 3:
            break
    during = _get(stats_url)[1]
    assert during["kv"]["used"] > before["kv"]["used"]  # the request holds blocks now
    stream.close()  # the client goes away mid-stream
    after = _wait_for(
        lambda: (
            (s := _get(stats_url)[1])["requests"]["running"] == 0
            and s["requests_finished_total"] > before["requests_finished_total"]
            and s
        )
    )
    assert after["kv"]["free"] == before["kv"]["free"]
    assert after["kv"]["used"] == before["kv"]["used"]
    # Aborted, not run to the end: far fewer than the 1500 tokens asked for were generated.
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < 1500


def test_client_timeout_on_a_non_streaming_request_frees_its_blocks(
    secured: ServerProcess,
) -> None:
    stats_url = secured.stats_url + "/stats"  # type: ignore[attr-defined]
    before = _get(stats_url)[1]
    client = openai.OpenAI(base_url=secured.url + "/v1", api_key=KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="tiny", prompt="q" * 200, max_tokens=1800,
                                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    after = _wait_for(
        lambda: (
            (s := _get(stats_url)[1])["requests"]["running"] == 0
            and s["requests_finished_total"] > before["requests_finished_total"]
            and s
        )
    )
    assert after["kv"]["free"] == before["kv"]["free"]
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 1800


def test_sigterm_drains_with_503_and_exits_zero() -> None:
    srv = ServerProcess("--model", "tiny", "--max-model-len", "4096", "--num-blocks", "512",
                        "--shutdown-grace", "3")  # fmt: skip
    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        finish: list[str | None] = []
        text: list[str] = []

        def long_stream() -> None:
            for chunk in client.completions.create(
                model="tiny", prompt="long", max_tokens=4000, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            ):  # fmt: skip
                if chunk.choices:
                    text.append(chunk.choices[0].text)
                    if chunk.choices[0].finish_reason:
                        finish.append(chunk.choices[0].finish_reason)

        t = threading.Thread(target=long_stream)
        t.start()
        _wait_for(lambda: len(text) > 2)
        assert srv.proc is not None
        srv.proc.terminate()  # SIGTERM
        _wait_for(lambda: _get(srv.url + "/ready")[0] == 503)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="late", max_tokens=1)
        assert info.value.status_code == 503
        assert "shutting down" in str(info.value)
        code = srv.wait(60)
        t.join(30)
    assert code == 0
    # 4000 tokens do not fit in a 3 s grace on this CPU: the stream ends, aborted, not cut off.
    assert finish == ["abort"]
    assert "shutting down" in srv.output and "stopped" in srv.output


async def test_a_draining_503_ends_its_kept_alive_connection_so_a_retry_reconnects() -> None:
    """A client's pooled connection (which a Service's conntrack pins to this pod) gets the
    draining 503 with `Connection: close` and `Retry-After`, so its retry connects anew and
    can reach another replica; the openai client's own retries do not all ride one
    connection. An in-flight stream keeps the server draining, and streaming, meanwhile."""
    srv = ServerProcess("--model", "tiny", "--max-model-len", "4096", "--num-blocks", "512",
                        "--shutdown-grace", "120")  # fmt: skip
    with srv:
        assert srv.proc is not None
        url = srv.url + "/v1/completions"
        events: list[str] = []  # the pooled session's connections: "new" or "reused"
        trace = aiohttp.TraceConfig()

        async def on_new(*_: object) -> None:
            events.append("new")

        async def on_reuse(*_: object) -> None:
            events.append("reused")

        trace.on_connection_create_end.append(on_new)
        trace.on_connection_reuseconn.append(on_reuse)
        pooled = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1), trace_configs=[trace]
        )
        # The stock openai client (2 retries), its attempts seen by an httpx response hook.
        attempts: list[tuple[int, int, str | None]] = []

        async def on_response(resp: Any) -> None:
            port = resp.extensions["network_stream"].get_extra_info("client_addr")[1]
            attempts.append((resp.status_code, port, resp.headers.get("connection")))

        http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [on_response]})
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", http_client=http)
        async with pooled, aiohttp.ClientSession() as other, client:
            hold, streamed, reader = await held_stream(other, url)

            async def post(prompt: str) -> tuple[int, dict[str, str], str]:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
                async with pooled.post(url, json=body) as r:
                    return r.status, dict(r.headers), (await r.read()).decode()

            # Both clients hold a kept-alive connection, opened before the drain.
            status, headers, _ = await post("warm")
            assert status == 200 and headers.get("Connection", "").lower() != "close"
            assert events == ["new"]
            assert (await client.completions.create(model="tiny", prompt="w", max_tokens=1)
                    ).choices  # fmt: skip
            deadline = time.monotonic() + 30
            while not streamed:
                assert time.monotonic() < deadline, "the in-flight stream sent nothing in 30 s"
                await asyncio.sleep(0.05)
            srv.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while (await asyncio.to_thread(_get, srv.url + "/ready"))[0] != 503:
                assert time.monotonic() < deadline, "the server did not start draining in 30 s"
                await asyncio.sleep(0.05)

            status, headers, body = await post("late")
            assert events == ["new", "reused"]  # it rode the kept-alive connection
            assert status == 503 and json.loads(body)["error"]["code"] == "draining"
            assert headers.get("Connection", "").lower() == "close", headers
            assert headers.get("Retry-After") == "1", headers
            status, headers, body = await post("retry")
            assert events == ["new", "reused", "new"], "the retry reused the draining connection"
            assert status == 503 and json.loads(body)["error"]["code"] == "draining"

            with pytest.raises(openai.InternalServerError) as info:
                await client.completions.create(model="tiny", prompt="late", max_tokens=1)
            assert info.value.status_code == 503 and info.value.code == "draining"
            assert [a[0] for a in attempts] == [200, 503, 503, 503], attempts
            assert {a[2] for a in attempts[1:]} == {"close"}, attempts
            assert len({a[1] for a in attempts[1:]}) > 1, f"retries on one connection: {attempts}"

            # The in-flight stream was served all along; hanging up ends the drain.
            assert not reader.done(), "the in-flight stream ended during the drain"
            reader.cancel()
            hold.close()
        code = await asyncio.to_thread(srv.wait, 60)
    assert code == 0


def test_pool_too_small_fails_fast_with_the_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code = server_main(["--model", "tiny", "--port", str(free_port()), "--num-blocks", "10",
                        "--max-model-len", "1024"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 2
    assert "cannot hold one sequence of max_model_len 1,024 tokens" in err
    assert "needs 64 blocks" in err
    assert "--num-blocks to at least 64" in err
    assert "--max-model-len to 160 or less" in err
    # An explicit --max-model-len is checked as the engine is built, before any budget line.
    assert "budget:" not in out


def test_a_default_max_model_len_is_capped_to_the_pool_and_served() -> None:
    # No --max-model-len: the tiny model's 8192 does not fit 8 x 16 tokens, so it is capped
    # (not a refusal, and not every max_tokens-less request rejected as exceeding the pool).
    with ServerProcess("--model", "tiny", "--num-blocks", "8", "--block-size", "16",
                       "--served-model-name", "tiny") as srv:  # fmt: skip
        status, models = _get(srv.url + "/v1/models")
        assert status == 200 and models["data"][0]["max_model_len"] == 128
        assert "max concurrency at max_model_len 128: 1 sequences" in srv.output
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )  # max_tokens unset: all the room left under the capped length
        assert chat.usage is not None and chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage.prompt_tokens + chat.usage.completion_tokens <= 128


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--block-size", "0"], "--block-size"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--shutdown-grace", "-1"], "--shutdown-grace"),
        (["--stats-port", "70000"], "--stats-port"),
        (["--stats-host", "0.0.0.0"], "--stats-host needs --stats-port"),
        (["--device", "cudax"], "device must be cpu, cuda, cuda:N or auto, got 'cudax'"),
        (["--model", "/nonexistent/model"], "--model: no directory /nonexistent/model"),
        # Settings the engine finds wrong only once the model is loaded are still bad flags.
        (["--kv-cache-memory", "100"], "kv_cache_memory_bytes 100 holds no block"),
        (["--max-model-len", "100000"], "exceeds the model's max_position_embeddings 8192"),
    ],
)
def test_bad_flags_name_the_flag(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert server_main(flags) == 2
    assert named in capsys.readouterr().err


def test_kv_cache_memory_units() -> None:
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5G") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        parse_bytes("lots")
    with pytest.raises(argparse.ArgumentTypeError, match="not a finite number"):
        parse_bytes("1e400")
