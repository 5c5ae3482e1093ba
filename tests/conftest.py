"""Settings shared by the whole test suite."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from hypothesis import settings

# No per-example deadline (Hypothesis' default is 200 ms): one garbage-collection pass of this
# suite's process takes 340-655 ms on a slow, loaded CI machine, and would fail whichever
# example it fell in with a DeadlineExceeded that says nothing about the code. The profile
# inherits the one Hypothesis loaded (its `ci` profile on CI); `--hypothesis-profile` still wins.
settings.register_profile("headroom", deadline=None)
settings.load_profile("headroom")


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    """Events the operator's handlers post through kopf.event (which needs a running operator),
    recorded instead (kopf is imported only by the tests that ask for this)."""
    out: list[tuple[str, str, str]] = []

    def event(body: Any, *, type: str, reason: str, message: str) -> None:
        out.append((type, reason, message))

    monkeypatch.setattr("kopf.event", event)
    return out


@pytest.fixture
def unresolvable_host(monkeypatch: pytest.MonkeyPatch) -> str:
    """A host name the resolver answers "no such name" for, without asking one (CI may have
    none, and a real lookup may wait on it); other names resolve as before."""
    name, resolve = "nowhere.test", socket.getaddrinfo

    def lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == name:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    return name
