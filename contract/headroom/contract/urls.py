"""URL checks shared by the parts' flags and specs."""

from __future__ import annotations

from urllib.parse import urlsplit


def http_url(url: str) -> str:
    """`url` when it is an http(s) URL with a host (and a port in 1..65535 if it names one);
    ValueError saying what is wrong otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL with a host, got {url!r}")
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"the port must be a number from 1 to 65535, got {url!r}")
    return url
