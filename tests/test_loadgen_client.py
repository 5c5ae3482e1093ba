"""`headroom load` end to end against a real `headroom serve --model tiny` subprocess."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import http.server
import io
import json
import select
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_process import ServerProcess, free_port

from headroom.engine.loadgen.cli import add_arguments, run
from headroom.engine.loadgen.client import (
    RunState,
    Target,
    _error_message,
    request_body,
    run_load,
)
from headroom.engine.loadgen.workload import LengthDist, RequestSpec, WorkloadSpec


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(
        "--model", "tiny", "--max-model-len", "1024", "--num-blocks", "256"
    ) as srv:  # fmt: skip
        yield srv


def _load(*flags: str) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(["--no-progress", "--stats-interval", "0.1", *flags]))


def test_ramped_shared_prefix_run_reports_latency_and_kv(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_csv = tmp_path / "run.json", tmp_path / "run.csv"
    code = _load(
        "--url", server.url, "-n", "16", "-c", "1", "--ramp-to", "4", "--ramp-duration", "0.3",
        "--prompt-len", "48", "--output-len", "8", "--shared-prefix-fraction", "0.5",
        "--prefix-len", "64", "--seed", "5", "--json", str(out_json), "--csv", str(out_csv),
    )  # fmt: skip
    report = capsys.readouterr().out
    assert code == 0
    data = json.loads(out_json.read_text())
    s = data["summary"]
    assert (s["requests"], s["ok"], s["errors"]) == (16, 16, 0)
    assert s["output_tokens"] == 16 * 8  # ignore_eos: every output runs to max_tokens
    for key in ("ttft", "tpot", "e2e"):
        d = s[key]
        assert d["count"] == 16 and 0 < d["p50"] <= d["p95"] <= d["p99"]
    recs = data["records"]
    assert sorted(r["index"] for r in recs) == list(range(16))
    # Prompts sized through the calibrated ratio land near their targets (+1 for BOS).
    for r in recs:
        target = (64 + 48 if r["shared_prefix"] else 48) + 1
        assert abs(r["prompt_tokens"] - target) <= 0.25 * target
    engine = s["engine"]
    assert engine is not None and engine["samples"] >= 2
    assert engine["capacity_blocks"] == 256
    assert 0 < engine["peak_occupancy"] <= 1
    shared = sum(r["shared_prefix"] for r in recs)
    assert shared >= 2  # so the later shared requests hit the prefix cache
    assert engine["hit_ratio"] is not None and engine["hit_ratio"] > 0
    assert engine["prefix_queries_tokens"] >= sum(r["prompt_tokens"] for r in recs) - 16
    assert len({r["concurrency"] for r in recs}) > 1 and len(s["levels"]) > 1
    rows = list(csv.DictReader(io.StringIO(out_csv.read_text())))
    assert len(rows) == 16 and {"ttft_s", "tpot_s", "prompt_tokens"} <= set(rows[0])
    assert "TTFT" in report and "peak occupancy" in report


def test_errors_are_counted_by_type(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _load("--url", server.url, "-n", "3", "-c", "3", "--prompt-len", "16",
                 "--output-len", "2000", "--json", "-")  # fmt: skip
    assert code == 1
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["errors_by_type"] == {"http_400_invalid_request_error": 3}
    assert all("max_model_len 1024" in r["error_message"] for r in data["records"])


def test_clients_that_hang_up_free_their_blocks(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _load("--url", server.url, "-n", "12", "-c", "4", "--prompt-len", "24",
                 "--output-len", "48", "--disconnect-fraction", "0.5", "--seed", "2",
                 "--json", "-")  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    cut = data["summary"]["errors_by_type"].get("client_disconnect", 0)
    assert code == 1 and cut > 0
    assert set(data["summary"]["errors_by_type"]) == {"client_disconnect"}
    assert data["summary"]["ok"] == 12 - cut
    # The server noticed every hang-up: its pool drains back to no used blocks.
    deadline = time.monotonic() + 10
    while (used := _stats(server)["kv"]["used"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert used == 0
    assert "Error handling request" not in server.output  # a hang-up is not a server error


def _stats(server: ServerProcess) -> Any:
    with urllib.request.urlopen(server.url + "/stats", timeout=5) as resp:
        return json.loads(resp.read())


def test_duration_mode_chat_endpoint_without_stats(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}/stats"
    code = _load("--url", server.url + "/v1", "--duration", "1.5", "-c", "2", "--endpoint", "chat",
                 "--prompt-len", "16", "--output-len", "4", "--stats-url", nowhere,
                 "--json", "-")  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0
    data = json.loads(captured.out)
    assert data["summary"]["ok"] >= 2
    assert all(r["start"] < 1.5 for r in data["records"])
    assert data["summary"]["engine"] is None
    assert "not reachable" in captured.err


def test_bad_flags_and_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    # A rule across flags names the flags, not the spec's fields.
    assert _load("--shared-prefix-fraction", "0.5") == 2
    assert "--shared-prefix-fraction > 0 needs --prefix-len > 0" in capsys.readouterr().err
    assert _load("--ramp-to", "4") == 2
    assert "a ramp over a request count needs --ramp-duration" in capsys.readouterr().err
    assert _load("--url", f"http://127.0.0.1:{free_port()}", "-n", "1") == 2
    assert "headroom load:" in capsys.readouterr().err
    for flags, says in (
        (["--url", "127.0.0.1:8000"], "--url: must be an http:// or https:// URL with a host"),
        (["--timeout", "-1"], "--timeout: must be a positive number, got -1"),
        (["--tokens-per-word", "nan"], "--tokens-per-word: must be a positive number, got nan"),
        (["--prompt-len", "0"], "--prompt-len: Input should be greater than or equal to 1"),
        (["--output-len-spread", "2"], "--output-len-spread: Input should be less than or equal"),
        (["--json", "/nonexistent/run.json"], "--json: no directory /nonexistent"),
        (["--json", "/tmp"], "--json: /tmp is a directory"),
        (["--temperature", "5"], "--temperature: Input should be less than or equal to 2"),
        # One destination for both: they interleaved on stdout, or the CSV overwrote the JSON.
        (["--json", "-", "--csv", "-"], "--json and --csv both name -: give each its own"),
        (["--json", "/tmp/x.out", "--csv", "/tmp/../tmp/x.out"], "both name /tmp/x.out"),
    ):
        assert _load("-n", "1", *flags) == 2, flags
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    """A stub server's request handler that logs nothing: the test's output stays its own."""

    def log_message(self, *args: object) -> None:
        pass


def _stub(handler: type[http.server.BaseHTTPRequestHandler]) -> tuple[http.server.HTTPServer, str]:
    """A server for `handler` on 127.0.0.1 at a free port, not serving yet, and its URL."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@contextlib.contextmanager
def _serving(srv: http.server.HTTPServer) -> Iterator[None]:
    """`srv` answering in a thread until the block ends."""
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        srv.shutdown()


@pytest.fixture
def web_page() -> Iterator[str]:
    """A server that answers every request 200 with a web page: the wrong port, say."""

    class Page(_QuietHandler):
        def _page(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html><body>Grafana</body></html>")

        do_GET = do_POST = _page

    srv, url = _stub(Page)
    with _serving(srv):
        yield url


def test_a_200_that_is_not_an_event_stream_is_not_a_served_request(
    web_page: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _load("--url", web_page, "--model", "m", "--tokens-per-word", "1", "-n", "2", "-c",
                 "1", "--no-stats", "--json", "-")  # fmt: skip
    assert code == 1
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["errors_by_type"] == {"no_stream": 2}
    assert _load("--url", web_page, "-n", "1", "--no-stats") == 2
    assert "/v1/models is not an OpenAI model list: give --model" in capsys.readouterr().err


def test_a_run_where_every_request_failed_writes_strict_json(
    web_page: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    code = _load("--url", web_page, "--model", "m", "--tokens-per-word", "1", "-n", "2",
                 "-c", "1", "--no-stats", "--json", str(out))  # fmt: skip
    assert code == 1

    def no_nan(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    summary = json.loads(out.read_text(), parse_constant=no_nan)["summary"]
    assert summary["errors"] == 2 and summary["ttft"]["p50"] is None
    capsys.readouterr()
    # A run too short to send anything measured nothing: not a success.
    assert _load("--url", web_page, "--model", "m", "--tokens-per-word", "1",
                 "--duration", "1e-9", "--no-stats") == 1  # fmt: skip
    assert "no request was sent" in capsys.readouterr().err


def test_an_unreachable_server_or_a_bad_port_exits_2_before_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for port in ("0", "65536", "99999", "x"):
        assert _load("--url", f"http://127.0.0.1:{port}", "--model", "m", "-n", "1") == 2
        assert "--url: the port must be a number from 1 to 65535" in capsys.readouterr().err
    closed = f"http://127.0.0.1:{free_port()}"
    for model in (["--model", "m", "--tokens-per-word", "1"], []):
        code = _load("--url", closed, *model, "-n", "50", "--no-stats", "--json", "-")
        captured = capsys.readouterr()
        assert code == 2, model
        assert f"cannot reach {closed}/v1/models" in captured.err
        assert captured.out == ""  # no run, so no report


class Scripted:
    """A server whose /v1/completions answers `body` as `content_type`, whatever was asked.

    `body` may be a list of parts, written `pause_s` apart. With `hangup_wait_s`, the answer
    waits that long after its headers for the client to hang up before writing any part;
    `parts_written` then holds, per request, how many parts went out before the client hung up
    (or all of them)."""

    def __init__(self) -> None:
        self.body: bytes | list[bytes] = b""
        self.content_type = "text/event-stream"
        self.pause_s = self.hangup_wait_s = 0.0
        self.parts_written: list[int] = []
        scripted = self

        class Handler(_QuietHandler):
            def do_GET(self) -> None:
                self._answer(b'{"object": "list", "data": [{"id": "m"}]}', "application/json")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer(scripted.body, scripted.content_type)

            def _answer(self, body: bytes | list[bytes], content_type: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.end_headers()
                if isinstance(body, bytes):
                    self.wfile.write(body)
                    return
                self.wfile.flush()
                written = 0
                if not (scripted.hangup_wait_s and self._hung_up(scripted.hangup_wait_s)):
                    for i, part in enumerate(body):
                        if i:
                            time.sleep(scripted.pause_s)
                        try:
                            self.wfile.write(part)
                            self.wfile.flush()
                        except OSError:  # the client hung up
                            break
                        written += 1
                scripted.parts_written.append(written)

            def _hung_up(self, wait_s: float) -> bool:
                """Whether the client closes its end within `wait_s` (it sends nothing more)."""
                readable, _, _ = select.select([self.connection], [], [], wait_s)
                return bool(readable) and self.connection.recv(1) == b""

        self.server, self.url = _stub(Handler)


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    srv = Scripted()
    with _serving(srv.server):
        yield srv


def _events(*events: str) -> bytes:
    return b"".join(f"data: {e}\n\n".encode() for e in (*events, "[DONE]"))


@pytest.mark.parametrize(
    "events",
    [
        ("[1, 2]",),
        ("[" * 100_000,),  # nested past the parser's recursion limit: it took the run down
        ('"text"',),
        ('{"choices": ["hi"]}',),
        ('{"choices": {"text": "hi"}}',),
        ('{"choices": [{"delta": "hi"}]}',),
        ('{"choices": [{"text": "hi"}]}', '{"choices": [], "usage": {"total_tokens": 4}}'),
        ('{"choices": [{"text": "hi"}]}',
         '{"choices": [], "usage": {"completion_tokens": "n/a", "prompt_tokens": 3}}'),
        ('{"choices": [{"text": "hi"}]}',
         '{"usage": {"completion_tokens": 1.5, "prompt_tokens": 3}}'),
    ],
)  # fmt: skip
def test_a_garbled_stream_fails_its_own_request_and_the_run_goes_on(
    scripted: Scripted, capsys: pytest.CaptureFixture[str], events: tuple[str, ...]
) -> None:
    scripted.body = _events(*events)
    code = _load("--url", scripted.url, "--model", "m", "--tokens-per-word", "1", "-n", "3",
                 "-c", "2", "--no-stats", "--json", "-")  # fmt: skip
    assert code == 1
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["errors_by_type"] == {"bad_response": 3}
    assert sorted(r["index"] for r in data["records"]) == [0, 1, 2]
    assert all(r["error_message"] for r in data["records"])


def test_a_stream_with_its_usage_counts_is_a_served_request(
    scripted: Scripted, capsys: pytest.CaptureFixture[str]
) -> None:
    usage = '{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}'
    scripted.body = _events('{"choices": [{"text": "a"}]}', '{"choices": [{"text": "b"}]}', usage)
    assert _load("--url", scripted.url, "-n", "1", "--tokens-per-word", "1", "--no-stats",
                 "--json", "-") == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    (rec,) = data["records"]
    assert (rec["prompt_tokens"], rec["output_tokens"], rec["usage_reported"]) == (5, 2, True)
    s = data["summary"]
    assert (s["prompt_tokens"], s["requests_without_usage"], s["warnings"]) == (5, 0, [])


def test_a_stream_without_usage_counts_reports_unknown_prompt_tokens_and_warns(
    scripted: Scripted, capsys: pytest.CaptureFixture[str]
) -> None:
    # A server that ignores stream_options.include_usage: 2 text chunks, 1 empty, no usage.
    scripted.body = _events('{"choices": [{"text": "a b"}]}', '{"choices": [{"text": ""}]}',
                            '{"choices": [{"text": "c", "finish_reason": "length"}]}')  # fmt: skip
    assert _load("--url", scripted.url, "-n", "2", "-c", "1", "--tokens-per-word", "1",
                 "--no-stats", "--json", "-") == 0  # fmt: skip
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert [(r["prompt_tokens"], r["output_tokens"], r["usage_reported"])
            for r in data["records"]] == [(None, 2, False)] * 2  # fmt: skip
    s = data["summary"]
    assert (s["prompt_tokens"], s["total_tokens_per_s"]) == (None, None)  # unknown, not 0
    assert (s["requests_without_usage"], s["output_tokens_estimated"]) == (2, True)
    assert s["output_tokens"] == 4 and s["output_tokens_per_s"] > 0  # chunks, an estimate
    assert len(s["warnings"]) == 1 and "2 of 2 ok requests streamed no usage" in s["warnings"][0]
    assert "WARNING: 2 of 2 ok requests streamed no usage counts" in captured.err
    assert "output tok/s (estimated)   - total tok/s" in captured.err


def _chunk(text: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode()


def test_tpot_is_vllms_end_to_end_minus_ttft_over_the_tokens_after_the_first(
    scripted: Scripted, capsys: pytest.CaptureFixture[str]
) -> None:
    # 3 tokens, then the usage chunk and [DONE] later: vLLM's benchmark_serving divides
    # (e2e - TTFT), to [DONE], not the span to the last token, by output tokens - 1.
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}\n\n'
    scripted.body = [_chunk("a"), _chunk("b"), _chunk("c"), usage, b"data: [DONE]\n\n"]
    scripted.pause_s = 0.05
    assert _load("--url", scripted.url, "--model", "m", "--tokens-per-word", "1", "-n", "1",
                 "--no-stats", "--json", "-") == 0  # fmt: skip
    (rec,) = json.loads(capsys.readouterr().out)["records"]
    assert rec["output_tokens"] == 3
    assert rec["tpot_s"] * 2 == pytest.approx(rec["e2e_s"] - rec["ttft_s"], rel=1e-9, abs=1e-12)


def test_a_hang_up_at_0_tokens_closes_on_the_headers_before_any_token(
    scripted: Scripted, capsys: pytest.CaptureFixture[str]
) -> None:
    # --output-len 1: every request draws disconnect_after = 0, "before the first token". The
    # server holds its first chunk until the client hangs up (or 5 s pass).
    scripted.body = [_chunk("a"), b"data: [DONE]\n\n"]
    scripted.hangup_wait_s = 5.0
    code = _load("--url", scripted.url, "--model", "m", "--tokens-per-word", "1", "-n", "1",
                 "--output-len", "1", "--disconnect-fraction", "1", "--no-stats",
                 "--json", "-")  # fmt: skip
    assert code == 1
    (rec,) = json.loads(capsys.readouterr().out)["records"]
    assert (rec["error"], rec["output_tokens"]) == ("client_disconnect", 0)
    assert rec["error_message"] == "hung up before the first token, as asked"
    deadline = time.monotonic() + 10
    while not scripted.parts_written and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scripted.parts_written == [0]  # the server never got to write a token


def test_a_hang_up_after_n_counts_text_chunks(
    scripted: Scripted, capsys: pytest.CaptureFixture[str]
) -> None:
    # --output-len 4 --seed 3: the first request hangs up after 2 text chunks; an event without
    # text (a role or usage chunk) does not count.
    scripted.body = [_chunk("a"), _chunk(""), _chunk("b c"), _chunk("d"), b"data: [DONE]\n\n"]
    code = _load("--url", scripted.url, "--model", "m", "--tokens-per-word", "1", "-n", "1",
                 "--output-len", "4", "--disconnect-fraction", "1", "--seed", "3", "--no-stats",
                 "--json", "-")  # fmt: skip
    assert code == 1
    (rec,) = json.loads(capsys.readouterr().out)["records"]
    assert (rec["error"], rec["output_tokens"]) == ("client_disconnect", 2)
    assert rec["error_message"] == "hung up after 2 text chunks, as asked"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"[]", "usage.prompt_tokens is not a token count"),
        (b"not json", "usage.prompt_tokens is not a token count"),
        (b'{"usage": {"total_tokens": 3}}', "usage.prompt_tokens is not a token count"),
        (b'{"usage": {"prompt_tokens": "7"}}', "usage.prompt_tokens is not a token count"),
        (b'{"usage": {"prompt_tokens": 7}}', "no more than the 16-word prompt's 7"),
    ],
)
def test_a_calibration_answer_without_a_usable_count_exits_2_with_the_reason(
    scripted: Scripted, capsys: pytest.CaptureFixture[str], body: bytes, says: str
) -> None:
    scripted.body, scripted.content_type = body, "application/json"
    assert _load("--url", scripted.url, "--model", "m", "-n", "1", "--no-stats") == 2
    err = capsys.readouterr().err
    assert says in err and "give --tokens-per-word" in err and "Traceback" not in err, err


def test_a_request_body_streams_with_usage_and_sends_ignore_eos_only_when_asked() -> None:
    """vLLM runs outputs to max_tokens only on `ignore_eos: true`; chat sends `messages`."""
    req = RequestSpec(
        index=0, prompt="hi there", prompt_tokens=2, max_tokens=7, shared_prefix=False
    )
    path, body = request_body(Target(), "m", req)
    assert path == "/completions"
    assert body == {"model": "m", "max_tokens": 7, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True,
                    "prompt": "hi there"}  # fmt: skip
    path, body = request_body(Target(endpoint="chat", ignore_eos=False, temperature=0.5), "m", req)
    assert path == "/chat/completions" and "ignore_eos" not in body and "prompt" not in body
    assert (body["messages"], body["temperature"]) == (
        [{"role": "user", "content": "hi there"}],
        0.5,
    )


def test_an_error_body_without_a_message_is_reported_as_its_first_200_characters() -> None:
    """A non-JSON error page becomes the record's message, cut so the JSON report stays small."""
    assert _error_message(None, "x" * 300) == "x" * 200
    assert _error_message({"error": {"message": "m" * 300}}, "fallback") == "m" * 300
    assert _error_message({"error": "flat"}, "fallback") == "fallback"


def test_a_stream_cut_before_done_names_how_many_events_arrived_and_keeps_the_finish_reason(
    scripted: Scripted, capsys: pytest.CaptureFixture[str]
) -> None:
    """Events without [DONE] are `stream_cut` (not `no_stream`); a finished one keeps its reason."""
    cut = _chunk("a") + b'data: {"choices": [{"text": "b", "finish_reason": "length"}]}\n\n'
    scripted.body = cut
    assert _load("--url", scripted.url, "--model", "m", "--tokens-per-word", "1", "-n", "1",
                 "--no-stats", "--json", "-") == 1  # fmt: skip
    (rec,) = json.loads(capsys.readouterr().out)["records"]
    assert (rec["ok"], rec["error"]) == (False, "stream_cut")
    assert rec["error_message"] == "the stream ended after 2 events without [DONE]"
    scripted.body = cut + b"data: [DONE]\n\n"
    assert _load("--url", scripted.url, "--model", "m", "--tokens-per-word", "1", "-n", "1",
                 "--no-stats", "--json", "-") == 0  # fmt: skip
    (rec,) = json.loads(capsys.readouterr().out)["records"]
    assert (rec["ok"], rec["finish_reason"], rec["output_tokens"]) == (True, "length", 2)


@pytest.mark.parametrize(
    ("body", "errors", "output_tokens"),
    [
        (_events('{"choices": [{"text": "a"}]}',
                 '{"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}'), 0, 6),
        (b'data: {"choices": [{"text": "a"}]}\n\n', 3, 0),  # cut off: no [DONE]
    ],
)  # fmt: skip
def test_the_progress_callbacks_last_state_counts_every_request_once(
    scripted: Scripted, body: bytes, errors: int, output_tokens: int
) -> None:
    """The progress bar's closing line reads the last RunState: started = done = all, none left."""
    scripted.body = body
    seen: list[RunState] = []
    spec = WorkloadSpec(num_requests=3, concurrency=2, prompt_len=LengthDist(mean=4),
                        output_len=LengthDist(mean=2))  # fmt: skip
    target = Target(base_url=scripted.url, model="m")
    result = asyncio.run(
        run_load(
            spec, target, tokens_per_word=1.0, on_progress=lambda s, _: seen.append(s.model_copy())
        )
    )
    assert len(result.records) == 3
    last = seen[-1]
    assert (last.started, last.done, last.in_flight) == (3, 3, 0)
    assert (last.errors, last.output_tokens) == (errors, output_tokens)


class Recorder:
    """A server that counts `base` + `per_word` tokens per prompt word for a calibration request,
    streams one token otherwise, and records every request body and the most streams open at
    once. A stream waits up to `hold_s` for a second one to open, so requests sent together
    overlap."""

    def __init__(self, hold_s: float = 0.3) -> None:
        self.base, self.per_word = 3, 2
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.most_in_flight = 0
        cond = threading.Condition()
        rec = self

        class Handler(_QuietHandler):
            def do_GET(self) -> None:
                self._send(b'{"object": "list", "data": [{"id": "m"}]}', "application/json")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                rec.bodies.append(body)
                if not body.get("stream"):
                    text = body.get("prompt") or body["messages"][0]["content"]
                    usage = {"prompt_tokens": rec.base + rec.per_word * len(text.split())}
                    self._send(json.dumps({"usage": usage}).encode(), "application/json")
                    return
                with cond:
                    rec.in_flight += 1
                    rec.most_in_flight = max(rec.most_in_flight, rec.in_flight)
                    cond.notify_all()
                    cond.wait_for(lambda: rec.in_flight > 1, timeout=hold_s)
                    rec.in_flight -= 1  # before the answer: the client's next request follows it
                self._send(_events('{"choices": [{"text": "a"}]}'), "text/event-stream")

            def _send(self, payload: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.end_headers()
                self.wfile.write(payload)

        self.server, self.url = _stub(Handler)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    srv = Recorder()
    with _serving(srv.server):
        yield srv


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_calibration_is_the_token_difference_of_two_greedy_one_token_prompts_per_word(
    recorder: Recorder, endpoint: Any
) -> None:
    """3 + 2 tokens per word: the 16- and 80-word prompts' difference gives 2.0 (the 3 cancels)."""
    spec = WorkloadSpec(num_requests=1, concurrency=1, prompt_len=LengthDist(mean=4),
                        output_len=LengthDist(mean=1))  # fmt: skip
    result = asyncio.run(run_load(spec, Target(base_url=recorder.url, endpoint=endpoint)))
    assert (result.model, result.tokens_per_word) == ("m", 2.0)
    calibration = [b for b in recorder.bodies if not b.get("stream")]
    assert [(b["max_tokens"], b["temperature"]) for b in calibration] == [(1, 0.0)] * 2


def test_a_ramp_sends_no_more_requests_at_once_than_its_current_level(recorder: Recorder) -> None:
    """Worker 1 waits while the ramp is at level 1 (for the first 300 s of 600), so the two
    requests go one after the other."""
    spec = WorkloadSpec(num_requests=2, concurrency=1, ramp_to=2, ramp_s=600,
                        prompt_len=LengthDist(mean=4), output_len=LengthDist(mean=1))  # fmt: skip
    result = asyncio.run(
        run_load(spec, Target(base_url=recorder.url, model="m"), tokens_per_word=1)
    )
    assert [(r.ok, r.concurrency) for r in result.records] == [(True, 1), (True, 1)]
    assert recorder.most_in_flight == 1


def test_a_calibration_where_the_longer_prompt_counts_fewer_tokens_names_both_counts(
    recorder: Recorder,
) -> None:
    """100 - 1 per word: 84 tokens for 16 words, 20 for 80, so no ratio can be read off."""
    recorder.base, recorder.per_word = 100, -1
    spec = WorkloadSpec(num_requests=1, concurrency=1, prompt_len=LengthDist(mean=4))
    with pytest.raises(RuntimeError) as info:
        asyncio.run(run_load(spec, Target(base_url=recorder.url)))
    assert str(info.value) == (
        "calibration: the 80-word prompt counted 20 tokens, no more than the 16-word prompt's "
        "84; give --tokens-per-word"
    )
