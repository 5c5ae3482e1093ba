"""A deployment of paged-KV engines under a trace, stepped in time: what the autoscalers act on.

Each pod is one engine with the KV pool the plan gives it. What it does is the engine's:
requests wait at the door in arrival order and are admitted while the engine's own admission
rule (`headroom.contract.admission.fits`: free blocks for the prompt plus the watermark, a
batch slot) says so, to the pod with the most free blocks (a KV-aware gateway); a request
longer than the engine's max model length is refused at the door, as the engine refuses it.
A sequence holds its prompt's blocks from admission, prefills at `prefill_tps`, then grows one
token per `1 / decode_tps` seconds; when growth finds no free block the pod preempts its newest
sequences by recompute (back to the front of the queue), as the engine's scheduler does.

Each pod also carries what its sidecar would report, computed with the sidecar's own
functions from the contract: the occupancy series and its segmented-fit saturation forecast
(`forecast_saturation`), and the demand counters (arrivals, departures, block-seconds) turned
into Little's-law rates (`demand.rates`). A new pod serves `pod_start` seconds after it is
asked for; a removed pod stops admitting, drains, and is gone when empty.

All pods' sequences live in one array so that a step is a handful of numpy calls.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from headroom.contract.admission import fits
from headroom.contract.demand import CounterSample, DemandRates, rates
from headroom.contract.forecast import forecast_saturation
from headroom.operator.scaling.decide import PodSample, PodView

SIDECAR_FORECAST_WINDOW = 30.0  # the sidecar's default --forecast-window
SIDECAR_WINDOW = 60.0  # the sidecar's default --window (rates, demand)

TOKENS, TOTAL, PROMPT, OWNER, DECODE_AT = range(5)  # the columns of World.seqs


@dataclass(frozen=True, slots=True)
class PodShape:
    """What one pod holds and how fast it works."""

    capacity_blocks: int
    block_size: int
    max_num_seqs: int
    watermark_blocks: int
    max_model_len: int
    gpus: int = 1
    decode_tps: float = 20.0  # tokens/s per running sequence
    prefill_tps: float = 10_000.0  # prompt tokens/s per sequence while it prefills
    pod_start: float = 120.0  # seconds from being asked for to serving


@dataclass
class Pod:
    """One engine and its sidecar's memory."""

    name: str
    uid: int
    created_at: float
    ready_at: float
    draining: bool = False
    blocks: int = 0
    seqs: int = 0
    waiting: int = 0
    arrived: int = 0
    departed: int = 0
    block_seconds: float = 0.0
    occupancy: deque[tuple[float, float]] = field(default_factory=deque)
    counters: deque[CounterSample] = field(default_factory=deque)
    preemptions: deque[float] = field(default_factory=deque)

    def ready(self, now: float) -> bool:
        return now >= self.ready_at and not self.draining

    def serving(self, now: float) -> bool:
        """Ready or draining: its sidecar answers."""
        return now >= self.ready_at


@dataclass
class Counters:
    """What a run is graded on."""

    saturated_seconds: float = 0.0
    queued_seconds: float = 0.0
    limited_seconds: float = 0.0
    preemptions: int = 0
    gpu_seconds: float = 0.0
    actions: int = 0
    peak: int = 0
    rejected: int = 0
    started: int = 0  # pods asked for
    cancelled: int = 0  # of those, removed before they served


@dataclass
class World:
    """Pods, every running sequence, the door's queue, and the counters."""

    shape: PodShape
    pods: list[Pod]
    seqs: np.ndarray = field(default_factory=lambda: np.zeros((0, 5)))
    pending: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    queue: deque[tuple[int, int]] = field(default_factory=deque)
    next_id: int = 0
    rr: int = 0  # the round-robin cursor that spreads arrivals over ready pods' counters
    counters: Counters = field(default_factory=Counters)
    counting: bool = True  # False during a warm-up: nothing is graded

    @classmethod
    def start(cls, shape: PodShape, replicas: int, now: float) -> World:
        """`replicas` pods, ready since long before `now`."""
        t = now - 3600.0
        pods = [Pod(f"pod-{i}", i, t - shape.pod_start, t) for i in range(replicas)]
        w = cls(shape, pods, next_id=replicas)
        w.counters.peak = replicas
        return w

    def replicas(self) -> int:
        """What the Deployment asks for: every pod not being removed."""
        return sum(1 for p in self.pods if not p.draining)

    def scale_to(self, n: int, now: float) -> None:
        """Ask for `n` pods: new ones serve after `pod_start`; removal drains the least loaded
        (pods still starting first, the newest of them first)."""
        # A ReplicaSet without pod-deletion-cost removes a starting pod first: unscheduled,
        # then pending, then loading (then the one on the most crowded node, the newest on a
        # log scale, at random), so mostly the newest, the furthest from serving, which is
        # what this replays. Of ready pods it removes the most recently ready one, not the
        # least loaded; replayed that way, headroom's cheapest serving settings on the bench's
        # five traces (6 seeds) cost within 0.2 % and lose within 1 s of the same median
        # seconds: a pod drains within its requests' tens of seconds, whichever it is.
        live = [p for p in self.pods if not p.draining]
        if n == len(live):
            return
        self.counters.actions += 1
        if n > len(live):
            self.counters.started += n - len(live)
            for _ in range(n - len(live)):
                self.next_id += 1
                self.pods.append(
                    Pod(f"pod-{self.next_id}", self.next_id, now, now + self.shape.pod_start)
                )
            self.counters.peak = max(self.counters.peak, n)
            return
        order = sorted(live, key=lambda p: (p.ready(now), p.blocks, -p.created_at))
        for p in order[: len(live) - n]:
            p.draining = True
            if now < p.ready_at:
                p.ready_at = now  # a pod that never served is simply gone
                self.counters.cancelled += 1

    def arrive(self, prompt: int, output: int, now: float) -> None:
        """A request at the door: refused if the engine would refuse it, else queued (and
        counted on a ready pod's arrivals, as a Service spreads requests)."""
        if prompt + output > self.shape.max_model_len:
            self.counters.rejected += self.counting
            return
        self.queue.append((prompt, prompt + output))
        ready = [p for p in self.pods if p.ready(now)]
        if ready:
            ready[self.rr % len(ready)].arrived += 1
            self.rr += 1

    def step(self, now: float, dt: float) -> bool:
        """Advance every sequence by `dt`, preempt where the pool overflows, admit from the
        queue, update the sidecars; returns whether any pod was saturated."""
        sh = self.shape
        if self.pending:
            self.seqs = np.concatenate([self.seqs, np.array(self.pending, dtype=float)])
            self.pending.clear()
        s = self.seqs
        decoding = s[:, DECODE_AT] <= now
        s[decoding, TOKENS] = np.minimum(
            s[decoding, TOKENS] + sh.decode_tps * dt, s[decoding, TOTAL]
        )
        done = s[:, TOKENS] >= s[:, TOTAL]
        if done.any():
            gone = np.bincount(s[done, OWNER].astype(np.intp), minlength=self.next_id + 1)
            for p in self.pods:
                p.departed += int(gone[p.uid])
            s = self.seqs = s[~done]
        per_seq = np.ceil(s[:, TOKENS] / sh.block_size)
        owner = s[:, OWNER].astype(np.intp)
        blocks = np.bincount(owner, weights=per_seq, minlength=self.next_id + 1)
        counts = np.bincount(owner, minlength=self.next_id + 1)
        requeue: list[tuple[int, int]] = []
        drop: list[np.ndarray] = []
        preempting: set[int] = set()
        for p in self.pods:
            p.blocks, p.seqs = int(blocks[p.uid]), int(counts[p.uid])
            if p.blocks <= sh.capacity_blocks:
                continue
            rows = np.flatnonzero(owner == p.uid)
            kept = int(np.searchsorted(np.cumsum(per_seq[rows]), sh.capacity_blocks, "right"))
            # As the engine's scheduler: the newest sequences go, each keeps the tokens it has
            # generated and recomputes them all when readmitted (prompt + output so far), and
            # the oldest of them waits at the front.
            out = rows[kept:]
            requeue += [(math.ceil(s[i, TOKENS]), int(s[i, TOTAL])) for i in out]
            p.blocks, p.seqs = int(per_seq[rows[:kept]].sum()), kept
            p.preemptions.extend([now] * len(out))
            drop.append(out)
            preempting.add(p.uid)
        if drop:
            self.seqs = np.delete(s, np.concatenate(drop), axis=0)
        self.counters.preemptions += len(requeue) if self.counting else 0
        saturated = bool(requeue) or any(
            p.ready(now) and p.blocks >= sh.capacity_blocks for p in self.pods
        )
        self.queue.extendleft(reversed(requeue))
        self._admit(now, preempting)
        self._observe(now, dt)
        self.pods = [p for p in self.pods if not (p.draining and p.seqs == 0)]
        return saturated

    def _admit(self, now: float, preempting: set[int]) -> None:
        """Admit from the door's queue in order, each request to the pod with the most free
        blocks that takes it (the first of equals); a pod that preempted in this step admits
        nothing (as the engine's scheduler)."""
        sh = self.shape
        ready = [p for p in self.pods if p.ready(now)]
        admitting = [p for p in ready if p.uid not in preempting]
        while self.queue and admitting:
            prompt, total = self.queue[0]
            need = -(-prompt // sh.block_size)
            takers = (
                q for q in admitting
                if fits(sh.capacity_blocks - q.blocks, need, sh.watermark_blocks, q.seqs,
                        sh.max_num_seqs)
            )  # fmt: skip
            best = min(takers, key=lambda q: q.blocks, default=None)
            if best is None:
                break
            decode_at = now + prompt / sh.prefill_tps
            self.pending.append((prompt, total, prompt, best.uid, decode_at))
            best.blocks += need
            best.seqs += 1
            self.queue.popleft()
        # The door's queue as the ready pods' waiting requests, every one counted.
        share, extra = divmod(len(self.queue), max(1, len(ready)))
        for p in self.pods:
            p.waiting = 0
        for i, p in enumerate(ready):
            p.waiting = share + (i < extra)

    def _observe(self, now: float, dt: float) -> None:
        """The sidecars' polls: occupancy for the forecast, the demand counters."""
        cap = self.shape.capacity_blocks
        for p in self.pods:
            if not p.serving(now):
                continue
            p.block_seconds += p.blocks * dt
            p.occupancy.append((now, p.blocks / cap))
            while p.occupancy[0][0] < now - SIDECAR_FORECAST_WINDOW:
                p.occupancy.popleft()
            p.counters.append(CounterSample(now, p.arrived, p.departed, p.block_seconds))
            while p.counters[0].t < now - SIDECAR_WINDOW:
                p.counters.popleft()
            while p.preemptions and p.preemptions[0] < now - SIDECAR_WINDOW:
                p.preemptions.popleft()

    def account(self, saturated: bool, dt: float) -> None:
        """Add one step to the graded counters."""
        c = self.counters
        c.gpu_seconds += len(self.pods) * self.shape.gpus * dt
        if saturated:
            c.saturated_seconds += dt
        if self.queue:
            c.queued_seconds += dt
        if saturated or self.queue:
            c.limited_seconds += dt

    def sample(self, p: Pod, now: float) -> PodSample | None:
        """What `p`'s sidecar reports now (None while it starts)."""
        if not p.serving(now):
            return None
        cap = self.shape.capacity_blocks
        fc = forecast_saturation(list(p.occupancy))
        eta, slope = fc.eta_seconds, fc.slope_per_second
        demand: DemandRates | None = rates(list(p.counters))
        return PodSample(
            occupancy=p.blocks / cap,
            sampled_at=now,
            eta_seconds=eta if eta is not None and math.isfinite(eta) else None,
            waiting=p.waiting,
            running=p.seqs,
            preemption_rate=len(p.preemptions) / SIDECAR_WINDOW,
            used_blocks=p.blocks,
            capacity_blocks=cap,
            growth_blocks_per_second=None if slope is None else slope * cap,
            demand=demand,
            counters=p.counters[-1] if p.counters else None,
        )

    def views(self, now: float) -> tuple[PodView, ...]:
        """The pods as the scaling loop sees them: readiness, start times, samples."""
        return tuple(
            PodView(
                name=p.name,
                ready=p.ready(now),
                created_at=p.created_at,
                terminating=p.draining,
                sample=self.sample(p, now),
                ready_since=p.ready_at if p.ready(now) else None,
            )
            for p in self.pods
        )
