"""`headroom serve`'s log lines carry the context attached with `extra=`: before, the format
printed only the message, so "requests failed in the engine" named neither the requests nor
the error."""

from __future__ import annotations

import logging

from headroom.engine.server.log_format import FORMAT, KeyValueFormatter


def _line(msg: str, exc: bool = False, **extra: object) -> str:
    record = logging.makeLogRecord({"name": "headroom.engine.failures", "levelname": "ERROR",
                                    "levelno": logging.ERROR, "msg": msg, **extra})  # fmt: skip
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            import sys

            record.exc_info = sys.exc_info()
    return KeyValueFormatter(FORMAT).format(record)


def test_extra_fields_follow_the_message_as_key_value() -> None:
    line = _line("requests failed in the engine", requests=["r1", "r2"],
                 error="RuntimeError: boom", window=4096)  # fmt: skip
    assert line.endswith(
        "ERROR headroom.engine.failures requests failed in the engine "
        "requests=\"['r1', 'r2']\" error='RuntimeError: boom' window=4096"
    )


def test_a_record_without_extras_is_the_plain_format_and_a_traceback_stays_below() -> None:
    assert _line("ready").endswith("ERROR headroom.engine.failures ready")
    head, _, tail = _line("step failed", exc=True, step=3).partition("\n")
    assert head.endswith("step failed step=3") and "RuntimeError: boom" in tail
