"""Replay a trace through a `World` under a scaling policy, and grade the run.

Every run starts from the same pods after a warm-up during which the policy observes (its
state builds up, as a running operator's would) and acts on nothing: the warm-up traffic is the
trace's own opening, replayed before the clock starts. The graded figures are GPU-hours and
KV-limited seconds: time during which a pod's cache is full or preempting, or requests wait at
the door for blocks (admission control turns saturation into queueing, so either one is the KV
cache turning work away).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from headroom.contract.admission import DEFAULT_WATERMARK, watermark_blocks
from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.reconcile.sizing import Sizing, size
from headroom.operator.scaling.decide import Decision, Inputs, Memory, Policy, decide
from headroom.operator.scaling.loop import policy_for
from headroom.operator.simulate.trace import Trace
from headroom.operator.simulate.world import PodShape, World

DT = 2.5  # simulation step, seconds (six to a decision)
TICK = 15.0  # the decision period
WARMUP = 600.0  # seconds of the trace's opening replayed before the clock starts
START_TARGET = 0.7  # the opening pods hold the opening demand at this occupancy


class ScalingPolicy(Protocol):
    """Anything that picks a replica count every tick."""

    def observe(self, world: World, now: float) -> None:
        """Warm-up: build state, act on nothing."""

    def __call__(self, world: World, now: float) -> int:
        """The replicas wanted now."""
        ...


class HeadroomPolicy:
    """The operator's `decide()` on what the pods' sidecars report, with its memory."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.memory = Memory()
        self.last: Decision | None = None

    def decide(self, world: World, now: float) -> Decision:
        d = decide(Inputs(now, world.replicas(), world.views(now), self.policy, self.memory))
        self.last = d
        return d

    def observe(self, world: World, now: float) -> None:
        d = self.decide(world, now)
        # Nothing acted on: the memory of changes stays as it was.
        self.memory = replace(d.memory, last_up=self.memory.last_up,
                              last_down=self.memory.last_down)  # fmt: skip

    def __call__(self, world: World, now: float) -> int:
        d = self.decide(world, now)
        self.memory = d.memory
        return d.replicas


@dataclass(frozen=True)
class Result:
    """One replay's graded figures."""

    limited_seconds: float
    saturated_seconds: float
    queued_seconds: float
    preemptions: int
    gpu_hours: float
    actions: int
    peak_replicas: int
    rejected: int
    pod_starts: int  # pods asked for
    cancelled_starts: int  # of those, removed before they served


def demand_curve(trace: Trace, shape: PodShape, steps: int, t0: float = 0.0) -> np.ndarray:
    """KV blocks held per step if every request were admitted on arrival (the oracle's view);
    step k covers t0 + k * DT."""
    return in_flight(trace, shape, steps, t0)[0]


def in_flight(
    trace: Trace, shape: PodShape, steps: int, t0: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """KV blocks and sequences in flight per step if every request were admitted on arrival;
    step k covers t0 + k * DT."""
    blocks, seqs = np.zeros(steps + 1), np.zeros(steps + 1)
    ok = trace.prompt + trace.output <= shape.max_model_len
    for a, p, o in zip(trace.arrival[ok], trace.prompt[ok], trace.output[ok], strict=True):
        start = int((a - t0) // DT)
        prefill = int(p / shape.prefill_tps // DT)
        dur = prefill + math.ceil(o / shape.decode_tps / DT)
        k = np.arange(dur)
        tokens = p + np.minimum(o, np.maximum(k - prefill, 0) * DT * shape.decode_tps)
        lo, hi = max(start, 0), min(steps, start + dur)
        if hi > lo:
            blocks[lo:hi] += np.ceil(tokens[lo - start : hi - start] / shape.block_size)
            seqs[lo:hi] += 1
    return blocks[:steps], seqs[:steps]


def graded_steps(trace: Trace) -> int:
    """The DT steps a replay grades: from t = 0 through the step that holds the last arrival
    (one on a step's boundary included)."""
    return int(float(trace.arrival[-1]) // DT) + 1 if len(trace) else 0


def with_warmup(trace: Trace, warmup: float = WARMUP) -> Trace:
    """The trace with its first `warmup` seconds replayed before it, at negative times."""
    head = trace.arrival < warmup
    return Trace(
        name=trace.name,
        arrival=np.concatenate([trace.arrival[head] - warmup, trace.arrival]),
        prompt=np.concatenate([trace.prompt[head], trace.prompt]),
        output=np.concatenate([trace.output[head], trace.output]),
    )


def opening_replicas(trace: Trace, shape: PodShape, warmup: float = WARMUP) -> int:
    """The pods that hold the opening demand at START_TARGET: every policy starts from them."""
    steps = int(warmup / DT)
    curve = demand_curve(trace, shape, steps)
    tail = curve[steps // 2 :] if steps > 1 else curve
    mean = float(tail.mean()) if len(tail) else 0.0
    return max(1, math.ceil(mean / (shape.capacity_blocks * START_TARGET)))


def replay(
    trace: Trace,
    shape: PodShape,
    policy: ScalingPolicy,
    start_replicas: int,
    warmup: float = WARMUP,
    on_tick: Callable[[float, World], None] | None = None,
    interval: float = TICK,
) -> Result:
    """Run `policy` over `trace` (times from 0; the warm-up replays its opening first),
    deciding every `interval` seconds (the spec's `scaling.intervalSeconds`)."""
    full = with_warmup(trace, warmup)
    world = World.start(shape, start_replicas, -warmup)
    steps = graded_steps(trace)
    tick = max(1, round(interval / DT))
    cursor = 0
    arrival, prompt, output = full.arrival, full.prompt, full.output
    for step in range(-int(warmup / DT), steps):
        now = step * DT
        world.counting = step >= 0  # before the arrivals: a refusal at t = 0 is graded
        while cursor < len(arrival) and arrival[cursor] < now + DT:
            world.arrive(int(prompt[cursor]), int(output[cursor]), now)
            cursor += 1
        saturated = world.step(now, DT)
        if step < 0:
            if step % tick == 0:
                policy.observe(world, now)
            continue
        if step % tick == 0:
            world.scale_to(policy(world, now), now)
            if on_tick is not None:
                on_tick(now, world)
        # After the decision: a pod asked for at `now` is paid from this step, as the floor
        # pays pod_start before a pod serves; one removed at `now` served this step and is paid
        # for it, and leaves once drained (the floor drops it at once: it stays below).
        world.account(saturated, DT)
    c = world.counters
    return Result(
        limited_seconds=c.limited_seconds,
        saturated_seconds=c.saturated_seconds,
        queued_seconds=c.queued_seconds,
        preemptions=c.preemptions,
        gpu_hours=c.gpu_seconds / 3600,
        actions=c.actions,
        peak_replicas=c.peak,
        rejected=c.rejected,
        pod_starts=c.started,
        cancelled_starts=c.cancelled,
    )


def shape_for(spec: InferenceDeploymentSpec, sizing: Sizing | None = None) -> PodShape:
    """The pod a spec deploys, as the simulator runs it: the planned KV pool, the engine's
    batch cap and watermark, the max model length, the pod's GPUs."""
    sizing = sizing or size(spec)
    cap = max(1, sizing.plan.kv_blocks_per_pod)
    return PodShape(
        capacity_blocks=cap,
        block_size=sizing.plan.block_size,
        max_num_seqs=spec.engine.max_num_seqs,
        watermark_blocks=watermark_blocks(DEFAULT_WATERMARK, cap),
        max_model_len=sizing.max_model_len,
        gpus=sizing.plan.gpus_per_pod,
        pod_start=float(spec.scaling.pod_start_seconds),
    )


def policy_at(
    spec: InferenceDeploymentSpec, quantile: float, sizing: Sizing | None = None
) -> Policy:
    """The spec's policy at one service level: the forecast's band at `quantile` (clamped to
    the CRD's [0.5, 0.999]) must fit the usable pools, with the mean allowed up to them (target
    occupancy 0.95, the scale-out line halfway to full). The one knob a sweep turns."""
    base = policy_for(spec, sizing or size(spec))
    target = min(0.95, base.usable_occupancy)
    return replace(
        base,
        forecast_quantile=min(0.999, max(0.5, quantile)),
        target_occupancy=target,
        scale_out_occupancy=(1 + target) / 2,
    )
