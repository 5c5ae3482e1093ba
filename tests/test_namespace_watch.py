"""The amended kopf namespace processor: a namespace first seen in a listing is watched."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kopf._cogs.structs import references
from kopf._core.reactor import observation

from headroom.operator import namespace_watch


def _see(insights: references.Insights, name: str, type_: str | None) -> None:
    event: Any = {"type": type_, "object": {"metadata": {"name": name}}}
    processor = observation.process_discovered_namespace_event
    asyncio.run(processor(raw_event=event, namespaces=["team-*"], insights=insights))


def test_listed_namespaces_are_revised_like_added_ones() -> None:
    assert namespace_watch.watch_listed_namespaces()
    insights = references.Insights()
    _see(insights, "team-a", None)  # from the watch's own listing: kopf dropped it
    _see(insights, "other", None)
    _see(insights, "team-b", "ADDED")
    assert insights.namespaces == {"team-a", "team-b"}
    _see(insights, "team-a", "DELETED")
    assert insights.namespaces == {"team-b"}


def test_another_kopf_layout_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(namespace_watch, "_observation", None)
    assert not namespace_watch.watch_listed_namespaces()
    assert "may go unwatched" in caplog.text
