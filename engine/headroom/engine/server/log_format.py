"""The log line format of `headroom serve`: the message, then each `extra=` field as key=value,
so the context a call site attaches (a stuck step's reason, the requests a failed step ended)
reaches the log rather than only the record."""

from __future__ import annotations

import logging

# Every attribute a LogRecord has of its own; anything else came from `extra=`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class KeyValueFormatter(logging.Formatter):
    """FORMAT, then ` key=value` per extra field (values with spaces or quotes repr'd)."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        if not extras:
            return line
        fields = " ".join(f"{k}={_value(v)}" for k, v in extras.items())
        head, sep, rest = line.partition("\n")  # a traceback stays below the fields
        return f"{head} {fields}{sep}{rest}"


def _value(v: object) -> str:
    s = str(v)
    return s if s and not any(c in s for c in " \t\n\"'=") else repr(s)


def configure(level: int) -> None:
    """Root logging to stderr in this format (what `logging.basicConfig` would do)."""
    handler = logging.StreamHandler()
    handler.setFormatter(KeyValueFormatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
