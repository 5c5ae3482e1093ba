"""kopf's observers, amended: a namespace or served CRD first seen in a relisting is acted on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from kopf._cogs.clients import fetching, scanning
from kopf._cogs.configs import configuration
from kopf._cogs.structs import references
from kopf._core.intents import registries
from kopf._core.reactor import observation, queueing

from headroom.operator import observers


@pytest.fixture(autouse=True)
def stock_kopf(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from kopf's own processors and leaves them as it found them."""
    for name, original in observers.ORIGINALS.items():
        monkeypatch.setattr(observation, name, original)
    yield


def _namespace(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": name}}


def _observe_namespaces(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """kopf's namespace_observer: team-a in its first listing, team-b created before its watch
    lists again (with team-a and other), then nothing."""

    async def fetch_objs(**_: Any) -> AsyncIterator[tuple[list[dict[str, Any]], str]]:
        yield [_namespace("team-a")], "1"

    async def watcher(*, processor: Any, **_: Any) -> None:
        for name in ("team-a", "team-b", "other"):
            await processor(raw_event={"type": None, "object": _namespace(name)})
        listed.set()
        await asyncio.Event().wait()

    listed = asyncio.Event()
    monkeypatch.setattr(fetching, "fetch_objs", fetch_objs)
    monkeypatch.setattr(queueing, "watcher", watcher)

    async def run() -> set[str]:
        insights = references.Insights()
        namespaces = references.Resource("", "v1", "namespaces", namespaced=False)
        await insights.backbone.fill(resources=[namespaces])
        task = asyncio.create_task(observation.namespace_observer(
            clusterwide=False, namespaces=["team-*"], insights=insights,
            settings=configuration.OperatorSettings()))  # fmt: skip
        await asyncio.wait_for(listed.wait(), 10)
        task.cancel()
        return {str(ns) for ns in insights.namespaces}

    return asyncio.run(run())


def test_a_namespace_created_between_the_two_listings_is_watched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _observe_namespaces(monkeypatch) == {"team-a"}  # kopf's own: team-b never watched
    assert observers.watch_listed(["headroom.dev"])
    assert _observe_namespaces(monkeypatch) == {"team-a", "team-b"}


def _crd(group: str) -> dict[str, Any]:
    return {"metadata": {"name": f"things.{group}"}, "spec": {"group": group}}


def test_only_a_served_groups_listed_crd_costs_a_discovery_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scanned: list[set[str]] = []

    async def scan_resources(*, groups: set[str], **_: Any) -> list[references.Resource]:
        scanned.append(groups)
        return []

    monkeypatch.setattr(scanning, "scan_resources", scan_resources)
    assert observers.watch_listed(["headroom.dev", "kopf.dev"])

    async def see(type_: str | None, group: str) -> None:
        processor: Any = observation.process_discovered_resource_event
        await processor(
            raw_event={"type": type_, "object": _crd(group)},
            settings=configuration.OperatorSettings(),
            registry=registries.OperatorRegistry(),
            insights=references.Insights(),
        )

    asyncio.run(see(None, "headroom.dev"))
    asyncio.run(see(None, "example.com"))  # listed, not ours: skipped as kopf skips it
    asyncio.run(see("ADDED", "example.com"))  # a change: kopf's own processor rescans
    asyncio.run(see(None, "kopf.dev"))
    assert scanned == [{"headroom.dev"}, {"example.com"}, {"kopf.dev"}]


def test_amending_twice_wraps_kopfs_processor_once() -> None:
    assert observers.watch_listed([]) and observers.watch_listed([])
    for name, original in observers.ORIGINALS.items():
        assert getattr(observation, name).__wrapped__ is original, name


def test_another_kopf_layout_is_left_alone_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def observer_binding_it_elsewhere() -> None:
        pass

    monkeypatch.setattr(observation, "namespace_observer", observer_binding_it_elsewhere)
    assert not observers.watch_listed(["headroom.dev"])
    assert (
        observation.process_discovered_namespace_event is observers.ORIGINALS[observers.NAMESPACES]
    )
    assert "may go unseen until it restarts" in caplog.text
    monkeypatch.setattr(observers, "_observation", None)
    assert not observers.watch_listed(["headroom.dev"])
