"""The simulated deployment step by step: what a run is charged, when a new pod serves, how the
door admits and a full pool preempts, and what each pod's sidecar reports."""

from __future__ import annotations

from dataclasses import replace

import pytest

from headroom.operator.simulate.world import (
    SIDECAR_FORECAST_WINDOW,
    SIDECAR_WINDOW,
    PodShape,
    World,
)
from headroom.sidecar.config import SidecarConfig

# A pool of 10 blocks of 16 tokens, 2 kept free at admission while anything runs, 3 sequences
# at most. Decoding is off unless a test turns it on, so blocks change only when it says.
SHAPE = PodShape(capacity_blocks=10, block_size=16, max_num_seqs=3, watermark_blocks=2,
                 max_model_len=1000, gpus=2, decode_tps=0.0, prefill_tps=1e9,
                 pod_start=30.0)  # fmt: skip
DT = 2.5


def blocks(n: int) -> int:
    """The tokens of a prompt of exactly `n` blocks."""
    return n * SHAPE.block_size


def test_a_run_pays_every_gpu_of_every_pod_and_counts_limited_time_once() -> None:
    # KV-limited is saturated or queued, each step counted once when both hold.
    world = World.start(SHAPE, 3, 0.0)
    world.account(False, DT)
    assert world.counters.gpu_seconds == 3 * 2 * DT
    assert (world.counters.saturated_seconds, world.counters.limited_seconds) == (0.0, 0.0)
    world.queue.append((16, 32))
    world.account(False, DT)
    world.account(True, DT)
    world.queue.clear()
    world.account(True, DT)
    c = world.counters
    assert (c.saturated_seconds, c.queued_seconds, c.limited_seconds) == (2 * DT, 2 * DT, 3 * DT)
    assert c.gpu_seconds == 4 * 3 * 2 * DT
    one = World.start(PodShape(10, 16, 3, 2, 1000), 3, 0.0)  # a pod is one GPU by default
    one.account(False, DT)
    assert one.counters.gpu_seconds == 3 * DT


def test_a_new_pod_is_paid_at_once_and_serves_exactly_pod_start_seconds_after_it_is_asked_for() -> (
    None
):
    world = World.start(SHAPE, 1, 0.0)
    (old,) = world.pods
    assert old.ready(0.0) and old.ready_at == -3600.0 and old.created_at == -3630.0
    world.scale_to(2, 10.0)
    new = world.pods[1]
    assert (new.created_at, new.ready_at) == (10.0, 40.0) and world.replicas() == 2
    assert (world.counters.started, world.counters.peak, world.counters.actions) == (1, 2, 1)
    world.account(False, DT)
    assert world.counters.gpu_seconds == 2 * 2 * DT  # starting, yet paid
    assert not new.ready(39.0) and world.sample(new, 39.0) is None
    assert new.ready(40.0) and world.sample(new, 40.0) is not None
    views = world.views(40.0)
    assert [v.ready_since for v in views] == [-3600.0, 40.0]
    assert [v.ready for v in world.views(39.0)] == [True, False]
    world.scale_to(2, 50.0)  # asking for what it has is no action
    assert world.counters.actions == 1
    world.scale_to(1, 50.0)  # the newest of two idle ready pods drains: it had served
    assert [p.draining for p in world.pods] == [False, True] and world.counters.cancelled == 0


def test_a_pod_removed_the_moment_it_turns_ready_is_not_a_cancelled_start() -> None:
    world = World.start(SHAPE, 1, 0.0)
    world.scale_to(2, 10.0)
    world.scale_to(1, 39.0)
    assert world.counters.cancelled == 1
    world.scale_to(2, 40.0)
    world.scale_to(1, 70.0)
    assert world.counters.cancelled == 1 and world.pods[-1].draining


def test_scaling_in_drains_the_least_loaded_ready_pod_which_is_paid_until_it_is_empty() -> None:
    world = World.start(replace(SHAPE, max_num_seqs=1, decode_tps=16.0), 2, 0.0)
    world.arrive(blocks(4), 500, 0.0)
    world.arrive(blocks(2), 60, 0.0)
    world.step(0.0, DT)
    assert [p.blocks for p in world.pods] == [4, 2]
    world.scale_to(1, DT)
    assert [p.draining for p in world.pods] == [False, True] and world.replicas() == 1
    assert world.counters.cancelled == 0  # it had served
    world.arrive(blocks(1), 100, DT)  # a draining pod admits nothing: it waits at the door
    world.step(DT, DT)  # 40 of the drained one's 60 tokens
    world.account(False, DT)
    assert len(world.pods) == 2 and world.counters.gpu_seconds == 2 * 2 * DT
    assert len(world.queue) == 1 and world.pods[1].seqs == 1
    world.step(2 * DT, DT)  # done: the pod is gone
    world.account(False, DT)
    assert [p.name for p in world.pods] == ["pod-0"] and world.counters.gpu_seconds == 3 * 2 * DT


def test_admission_keeps_the_watermark_free_while_anything_runs_and_honours_the_batch_cap() -> None:
    world = World.start(SHAPE, 1, 0.0)
    world.arrive(blocks(10), 100, 0.0)  # the whole empty pool: no watermark with nothing running
    assert not world.step(0.0, DT)
    assert world.pods[0].blocks == 10 and not world.queue
    assert world.step(DT, DT)  # a full pool is saturated, though nothing is preempted
    assert world.counters.preemptions == 0
    world.scale_to(0, 2 * DT)
    assert not world.step(2 * DT, DT)  # ... unless it is draining: no longer asked for

    world = World.start(SHAPE, 1, 0.0)
    for n in (4, 4, 1):  # 4 + 4 + 2 free fits exactly, then 1 + 2 does not fit the 0 left
        world.arrive(blocks(n), 100, 0.0)
    world.step(0.0, DT)
    assert (world.pods[0].blocks, world.pods[0].seqs, len(world.queue)) == (8, 2, 1)
    assert not world.step(DT, DT)  # 8 of 10 blocks, requests waiting: queued, not saturated

    world = World.start(SHAPE, 1, 0.0)
    world.arrive(blocks(4), 100, 0.0)
    world.arrive(blocks(5), 100, 0.0)  # 4 + 5 leaves 1 free, short of the watermark's 2
    world.step(0.0, DT)
    assert (world.pods[0].seqs, len(world.queue), world.pods[0].waiting) == (1, 1, 1)

    world = World.start(SHAPE, 1, 0.0)
    for _ in range(4):
        world.arrive(blocks(1) - 1, 100, 0.0)  # a partial block takes a whole one
    world.step(0.0, DT)
    assert (world.pods[0].blocks, world.pods[0].seqs, len(world.queue)) == (3, 3, 1)


def test_each_request_goes_to_the_pod_with_the_most_free_blocks_the_first_of_equals() -> None:
    world = World.start(SHAPE, 2, 0.0)
    for n in (3, 2, 1):
        world.arrive(blocks(n), 100, 0.0)
    world.step(0.0, DT)
    # 3 to pod-0 (equal, the first), 2 to pod-1 (fewer), 1 to pod-1 (2 < 3).
    assert [(p.blocks, p.seqs) for p in world.pods] == [(3, 1), (3, 2)]


def test_requests_up_to_the_max_model_length_are_queued_and_longer_ones_counted_refused() -> None:
    world = World.start(SHAPE, 1, 0.0)
    world.arrive(900, 100, 0.0)
    world.arrive(900, 101, 0.0)
    assert len(world.queue) == 1 and world.counters.rejected == 1
    world.counting = False  # a warm-up refuses without grading it
    world.arrive(900, 101, 0.0)
    assert world.counters.rejected == 1


def test_arrivals_are_counted_round_robin_on_ready_pods_only() -> None:
    world = World.start(SHAPE, 3, 0.0)
    world.scale_to(4, 0.0)  # starting: no arrivals counted on it
    for _ in range(5):
        world.arrive(16, 16, 0.0)
    assert [p.arrived for p in world.pods] == [2, 2, 1, 0]


def test_requests_wait_at_the_door_while_no_pod_serves_and_go_to_the_first_that_does() -> None:
    world = World.start(SHAPE, 0, 0.0)
    world.scale_to(1, 0.0)
    world.arrive(16, 16, 0.0)
    world.step(0.0, DT)
    (pod,) = world.pods
    assert len(world.queue) == 1 and pod.waiting == 0 and pod.arrived == 0
    world.step(30.0, DT)
    assert not world.queue and pod.seqs == 1


def test_a_pool_that_overflows_preempts_its_newest_sequence_to_the_front_of_the_queue() -> None:
    shape = replace(SHAPE, decode_tps=1.0, watermark_blocks=0)
    world = World.start(shape, 1, 0.0)
    for _ in range(2):
        world.arrive(blocks(5), 500, 0.0)
    world.arrive(16, 16, 0.0)  # no block left: it waits
    assert not world.step(0.0, 1.0)
    assert (world.pods[0].blocks, world.pods[0].seqs, len(world.queue)) == (10, 2, 1)
    # One token each: both need a sixth block, 12 > 10, and the newer one goes, keeping its
    # 81 tokens, to wait ahead of the request that was already waiting.
    assert world.step(1.0, 1.0)
    p = world.pods[0]
    assert (p.blocks, p.seqs, world.counters.preemptions) == (6, 1, 1)
    assert list(world.queue) == [(81, 80 + 500), (16, 32)]
    sample = world.sample(p, 1.0)
    assert sample is not None and sample.preemption_rate == 1 / 60.0
    assert p.preemptions[0] == 1.0
    for t in range(2, 62):  # it grows into its ninth block, no further preemption
        world.step(float(t), 1.0)
    assert list(p.preemptions) == [1.0]  # a minute after it, still in the sidecar's window
    world.step(62.0, 1.0)
    assert not p.preemptions and world.counters.preemptions == 1


def test_a_sequence_decodes_once_its_prefill_is_done_and_leaves_when_its_output_is() -> None:
    # 16 prompt tokens prefill in 4 s, then 8 tokens per 2 s step; 16 output tokens in all.
    shape = replace(SHAPE, decode_tps=4.0, prefill_tps=4.0)
    world = World.start(shape, 1, 0.0)
    world.arrive(blocks(1), 16, 0.0)
    p = world.pods[0]
    world.step(0.0, 2.0)
    world.step(2.0, 2.0)  # still prefilling: its prompt's one block
    assert (p.blocks, p.seqs) == (1, 1) and world.seqs[0, 0] == 16
    world.step(4.0, 2.0)  # 24 tokens: a second block
    assert p.blocks == 2
    world.step(6.0, 2.0)  # 32: done
    assert (p.blocks, p.seqs, p.departed) == (0, 0, 1)


def test_the_sidecar_integrates_blocks_over_time_and_keeps_only_its_windows() -> None:
    fields = SidecarConfig.model_fields  # the windows are the sidecar's own defaults
    assert (SIDECAR_FORECAST_WINDOW, SIDECAR_WINDOW) == (
        fields["forecast_window"].default, fields["window"].default
    ) == (30.0, 60.0)  # fmt: skip
    world = World.start(SHAPE, 1, 0.0)
    world.arrive(blocks(4), 100, 0.0)
    for k in range(40):
        world.step(k * DT, DT)
    p = world.pods[0]
    # Admitted on the first step, held 4 blocks on each of the 40 polls.
    assert p.block_seconds == 4 * 40 * DT
    now = 39 * DT
    assert p.occupancy[0][0] == now - 30.0 and p.occupancy[-1] == (now, 0.4)
    assert p.counters[0].t == now - 60.0 and p.counters[-1].block_seconds == 400.0
    s = world.sample(p, now)
    assert s is not None
    assert (s.occupancy, s.used_blocks, s.capacity_blocks, s.running) == (0.4, 4, 10, 1)
    assert s.eta_seconds is None and s.growth_blocks_per_second == pytest.approx(0.0)


def test_the_sidecar_reports_growth_in_blocks_per_second_and_the_seconds_to_full() -> None:
    # One more one-block request admitted every 2.5 s step: 0.4 blocks/s on a 100-block pool.
    shape = replace(SHAPE, capacity_blocks=100, max_num_seqs=64, watermark_blocks=0)
    world = World.start(shape, 1, 0.0)
    for k in range(10):
        world.arrive(16, 16, k * DT)
        world.step(k * DT, DT)
    s = world.sample(world.pods[0], 9 * DT)
    assert s is not None and (s.used_blocks, s.occupancy) == (10, 0.1)
    assert s.growth_blocks_per_second == pytest.approx(1 / DT)
    assert s.eta_seconds == pytest.approx(90 * DT)
    assert s.counters is not None and s.counters.arrived == 10
