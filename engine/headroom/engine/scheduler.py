"""Continuous batching over the block pool: admission, chunked prefill, decode, preemption.

One step, `schedule()`:
1. Running sequences, oldest admission first, each get their next tokens: one for a decode,
   a chunk of the prompt (bounded by the per-step token budget, less one token kept back for
   every decode still to come) for a prefill. A sequence that needs a block when none is left,
   even after evicting cached prefix blocks, preempts the most recently admitted sequence by
   recompute (its blocks freed, itself requeued at the front of the waiting queue) until it
   fits; a prefill chunk shrinks to the blocks it can get before preempting anyone. KV never
   runs out: at worst the oldest sequence runs alone, and `add` rejects what cannot fit alone.
2. Waiting sequences are admitted first come, first served while the budget, `max_num_seqs`
   and the blocks allow, keeping `watermark` of the pool free for running decodes. Admission
   reuses the longest cached prefix in whole blocks, stopping one token short of the end so
   the last token is computed and its logits can be sampled.

The engine runs the model on `SchedulerOutput`, then calls `update` with the sampled tokens;
`update` advances the sequences and makes newly full blocks findable in the prefix cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from headroom.contract.budget import KVCacheDtype, ModelArch, Plan, kv_bytes_per_block
from headroom.contract.stats import KVBlockStats, PrefixCacheStats, RequestStats, SchedulerStats
from headroom.engine.block_pool import BlockPool
from headroom.engine.errors import RequestRejected
from headroom.engine.prefix_cache import (
    ROOT_REF,
    HashFn,
    extend_block_hashes,
    hash_block_tokens,
)
from headroom.engine.scheduled import ScheduledSeq, SchedulerOutput
from headroom.engine.sequence import Sequence, SequenceStatus
from headroom.engine.validation import resolve_max_tokens

_WAITING = SequenceStatus.WAITING
_RUNNING = SequenceStatus.RUNNING
_FINISHED = SequenceStatus.FINISHED


class SchedulerConfig(BaseModel):
    """Pool size and batching limits; invalid values raise ValueError naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_blocks: int = Field(ge=1, description="KV blocks in the pool")
    block_size: int = Field(default=16, ge=1, le=1024, description="tokens per block")
    max_model_len: int = Field(ge=1, description="longest prompt + max_tokens accepted")
    max_num_seqs: int = Field(default=256, ge=1, description="sequences per step")
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, description="tokens per step; longer prompts prefill in chunks"
    )
    enable_prefix_caching: bool = True
    watermark: float = Field(
        default=0.01, ge=0.0, lt=1.0, description="fraction of blocks kept free at admission"
    )
    bytes_per_token: int = Field(default=0, ge=0, description="KV bytes per token (stats only)")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    @classmethod
    def from_plan(cls, plan: Plan, max_model_len: int, **overrides: Any) -> SchedulerConfig:
        """A pod's pool as `headroom.contract.budget.plan` sized it."""
        if plan.kv_blocks_per_pod < 1:
            raise ValueError(f"the plan leaves no KV blocks per pod: {plan.reason or 'no memory'}")
        values: dict[str, Any] = {
            "num_blocks": plan.kv_blocks_per_pod,
            "block_size": plan.block_size,
            "bytes_per_token": plan.kv_bytes_per_token_per_gpu,
            "max_model_len": max_model_len,
        }
        return cls(**{**values, **overrides})

    @classmethod
    def from_budget(
        cls,
        arch: ModelArch,
        kv_bytes_per_gpu: int,
        max_model_len: int,
        *,
        block_size: int = 16,
        kv_dtype: KVCacheDtype = "bf16",
        tp: int = 1,
        pp: int = 1,
        **overrides: Any,
    ) -> SchedulerConfig:
        """As many blocks as `kv_bytes_per_gpu` holds for this architecture."""
        per_block = kv_bytes_per_block(arch, block_size, kv_dtype, tp, pp)
        num_blocks = kv_bytes_per_gpu // per_block
        if num_blocks < 1:
            raise ValueError(
                f"{kv_bytes_per_gpu} KV bytes hold no block of {block_size} tokens "
                f"({per_block} bytes each for {arch.name} at {kv_dtype})"
            )
        return cls(
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            bytes_per_token=per_block // block_size,
            **overrides,
        )


@dataclass(slots=True)
class _Step:
    """What one `schedule()` call carries between its fast and slow paths."""

    window: int  # running sequences this step may reach (max_num_seqs, less the preempted)
    pending: int  # decodes not yet reached, one budget token held back for each
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


class Scheduler:
    """Owns the block pool and every unfinished sequence (see the module docstring)."""

    __slots__ = (
        "_inflight",
        "_max_num_batched_tokens",
        "_max_num_seqs",
        "_seqs",
        "_watermark_blocks",
        "block_size",
        "config",
        "last_step_schedule_seconds",
        "pool",
        "preemptions_total",
        "running",
        "steps_total",
        "waiting",
    )

    def __init__(self, config: SchedulerConfig, *, hash_fn: HashFn = hash_block_tokens) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(
            config.num_blocks, config.block_size, config.enable_prefix_caching, hash_fn
        )
        self.waiting: deque[Sequence] = deque()
        # Admission order: the tail is the most recently admitted, the first to be preempted.
        self.running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}
        self._inflight: SchedulerOutput | None = None
        self._max_num_seqs = config.max_num_seqs
        self._max_num_batched_tokens = config.max_num_batched_tokens
        self._watermark_blocks = config.watermark_blocks
        self.preemptions_total = 0
        self.steps_total = 0
        self.last_step_schedule_seconds = 0.0

    # -- requests -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a fresh sequence; raises `RequestRejected` if it could never be served."""
        self._check(seq)
        self.waiting.append(seq)
        self._seqs[seq.seq_id] = seq

    def _check(self, seq: Sequence) -> None:
        cfg = self.config
        if seq.seq_id in self._seqs:
            raise RequestRejected(f"sequence {seq.seq_id} was already added")
        if seq.status is not _WAITING or seq.block_table or seq.num_computed_tokens:
            raise RequestRejected(
                f"sequence {seq.seq_id} is {seq.status.value}, not a fresh waiting sequence"
            )
        if not seq.prompt_token_ids:
            raise RequestRejected("the prompt is empty", param="prompt", code="empty_prompt")
        prompt, out = seq.num_prompt_tokens, seq.max_tokens
        resolve_max_tokens(prompt, out, cfg.max_model_len)
        total = prompt + out
        blocks = -(-total // cfg.block_size)
        if blocks > cfg.num_blocks:
            raise RequestRejected(
                f"prompt {prompt} + max_tokens {out} = {total} tokens needs {blocks} KV blocks "
                f"of {cfg.block_size} tokens but the whole pool holds {cfg.num_blocks}",
                param="max_tokens",
                code="exceeds_kv_pool",
            )

    def get(self, seq_id: int) -> Sequence | None:
        """An unfinished sequence (waiting or running), or None."""
        return self._seqs.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, seq_id: int) -> bool:
        """End a sequence (stop token, stop string, max_tokens): its blocks are released and
        full hashed ones stay cached. False if the id is unknown or already finished."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._release(seq)
        return True

    def abort(self, seq_id: int) -> bool:
        """Drop a sequence at once, waiting or running (the client went away)."""
        return self.finish(seq_id)

    def abort_request(self, request_id: str) -> int:
        """Abort every sequence of a request (a parent and its forks); returns how many."""
        ids = [s.seq_id for s in self._seqs.values() if s.request_id == request_id]
        for seq_id in ids:
            self.finish(seq_id)
        return len(ids)

    def _release(self, seq: Sequence) -> None:
        if seq.status is _RUNNING:
            self.running.remove(seq)
            self._free_blocks(seq)
        else:
            self.waiting.remove(seq)
        seq.status = _FINISHED
        del self._seqs[seq.seq_id]

    def _free_blocks(self, seq: Sequence) -> None:
        # Tail first: the end of a sequence is evicted before the prefix others may share.
        self.pool.free_many(reversed(seq.block_table))
        seq.block_table.clear()
        seq.num_registered_blocks = 0
        seq.cache_parent_ref = ROOT_REF

    def _preempt(self, seq: Sequence) -> None:
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = _WAITING
        self.waiting.appendleft(seq)
        self.preemptions_total += 1

    # -- n > 1 sampling -------------------------------------------------------------------

    def fork(self, parent_seq_id: int, n: int) -> list[Sequence]:
        """`n` children sharing every block of a running parent by reference count.

        The moment: after the model ran the step in which the parent's prompt prefill
        completed (its `ScheduledSeq.sample` is True) and before `update`. Sample one token
        per sequence from the parent's logits row and pass them all to `update`: the children
        are attached to the in-flight step (`SchedulerOutput.forked`), so `update` advances
        them exactly as it advances the parent. Outside a step, children copy the parent as is.
        Appending to a shared partly filled block later copies it first (`blocks_to_copy`).
        """
        if n < 0:
            raise ValueError(f"cannot fork {n} children")
        parent = self._seqs.get(parent_seq_id)
        if parent is None or parent.status is not _RUNNING:
            raise ValueError(f"sequence {parent_seq_id} is not running; only a running one forks")
        inflight = self._inflight
        entry = None
        if inflight is not None:
            entry = next((e for e in inflight.scheduled if e.seq is parent), None)
        share = self.pool.share
        children: list[Sequence] = []
        for _ in range(n):
            child = parent.clone()
            for block_id in child.block_table:
                share(block_id)
            self.running.append(child)
            self._seqs[child.seq_id] = child
            if inflight is not None and entry is not None:
                inflight.forked.append(ScheduledSeq(child, entry.start, entry.num_new_tokens))
            children.append(child)
        return children

    # -- the step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring); allocates the blocks it needs."""
        if self._inflight is not None:
            raise RuntimeError("schedule() called again before update() for the previous step")
        t0 = time.perf_counter()
        bs = self.block_size
        pool = self.pool
        ref_counts = pool.ref_counts
        allocate = pool.allocate
        running = self.running
        max_seqs = self._max_num_seqs
        budget = self._max_num_batched_tokens
        prefills: list[ScheduledSeq] = []
        decodes: list[ScheduledSeq] = []

        # One budget token is held back for every decode not yet reached, so a prefill chunk
        # early in the order cannot starve the decodes behind it.
        window = min(len(running), max_seqs)
        pending = 0
        for k in range(window):
            s = running[k]
            if len(s.all_token_ids) - s.num_computed_tokens == 1:
                pending += 1
        step = _Step(window, pending)

        available = pool.num_available
        i = 0
        while i < len(running) and i < max_seqs and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            remaining = len(seq.all_token_ids) - computed
            decoding = remaining == 1
            if decoding:
                step.pending -= 1
                # Fast path, nearly every decode: room in an unshared last block, or a block free.
                table = seq.block_table
                if computed % bs:
                    if ref_counts[table[-1]] == 1:
                        decodes.append(ScheduledSeq(seq, computed, 1, True))
                        budget -= 1
                        i += 1
                        continue
                elif available:
                    table.append(allocate())
                    available -= 1
                    decodes.append(ScheduledSeq(seq, computed, 1, True))
                    budget -= 1
                    i += 1
                    continue
                n = 1
            else:
                n = min(remaining, budget - step.pending)
                if n <= 0:
                    i += 1
                    continue
            n = self._make_room(seq, n, decoding, step)
            if n == 0:
                break  # `seq` itself was preempted: nothing behind it can run either
            available = pool.num_available
            sample = n == remaining
            entry = ScheduledSeq(seq, computed, n, sample)
            (decodes if n == 1 and sample else prefills).append(entry)
            budget -= n
            i += 1
        preempted = step.preempted

        # Admitting right after a preemption would only thrash, unless nothing else can run.
        if self.waiting and (not preempted or not (prefills or decodes)):
            budget = self._admit(budget, prefills, decodes)

        out = SchedulerOutput(
            scheduled=prefills + decodes,
            blocks_to_copy=step.copies,
            preempted=preempted,
            num_prefills=len(prefills),
        )
        if out.scheduled:
            self._inflight = out
            self.steps_total += 1
        self.last_step_schedule_seconds = time.perf_counter() - t0
        return out

    def _make_room(self, seq: Sequence, n: int, decoding: bool, step: _Step) -> int:
        """The slow path, when `seq`'s next `n` tokens need blocks the fast path lacks: shrink
        a prefill chunk to the room there is, else preempt from the back of the running queue
        until it fits. Allocates the blocks (copy-on-write of a shared last block first) and
        returns the tokens scheduled; 0 when `seq` itself had to be preempted."""
        bs = self.block_size
        pool = self.pool
        ref_counts = pool.ref_counts
        running = self.running
        table = seq.block_table
        computed = seq.num_computed_tokens
        available = pool.num_available
        while True:
            cow = computed % bs != 0 and ref_counts[table[-1]] > 1
            need = (computed + n + bs - 1) // bs - len(table) + cow
            if need <= available:
                break
            if not decoding:
                fit = len(table) * bs - computed + (available - cow) * bs
                if fit >= 1:
                    n = fit
                    continue
            victim = running.pop()
            if victim is not seq and len(running) < step.window:
                step.window -= 1
                if len(victim.all_token_ids) - victim.num_computed_tokens == 1:
                    step.pending -= 1
            self._preempt(victim)
            step.preempted.append(victim)
            available = pool.num_available
            if victim is seq:
                return 0
        if cow:
            old = table[-1]
            table[-1] = pool.copy_on_write(old)
            step.copies.append((old, table[-1]))
            need -= 1
        for _ in range(need):
            table.append(pool.allocate())
        return n

    def _admit(self, budget: int, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq]) -> int:
        bs = self.block_size
        pool = self.pool
        cache = pool.prefix_cache
        ref_counts = pool.ref_counts
        waiting = self.waiting
        running = self.running
        while waiting and budget > 0 and len(running) < self._max_num_seqs:
            seq = waiting[0]
            num_tokens = seq.num_tokens
            hits: list[int] = []
            if cache is not None:
                # Stop one token short: the last token must be computed to sample from it.
                max_blocks = (num_tokens - 1) // bs
                hashes = seq.block_hashes
                if len(hashes) < max_blocks:
                    extend_block_hashes(
                        hashes, seq.all_token_ids, bs, max_blocks, seq.extra_key, cache.hash_fn
                    )
                hits = cache.match(hashes, seq.all_token_ids, bs, seq.extra_key, max_blocks)
            num_cached = len(hits) * bs
            n = min(num_tokens - num_cached, budget)
            need = (num_cached + n + bs - 1) // bs - len(hits)
            revived = sum(1 for b in hits if ref_counts[b] == 0)
            # The watermark keeps room for running decodes; with none running it would only
            # block a sequence that fits the empty pool.
            reserve = self._watermark_blocks if running else 0
            if need + revived + reserve > pool.num_available:
                break
            waiting.popleft()
            table = seq.block_table
            for b in hits:  # revive before allocating, so allocation cannot evict a hit
                pool.share(b)
                table.append(b)
            for _ in range(need):
                table.append(pool.allocate())
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.num_registered_blocks = len(hits)
            if cache is not None:
                seq.cache_parent_ref = cache.ref(hits[-1]) if hits else ROOT_REF
            seq.status = _RUNNING
            running.append(seq)
            if cache is not None:
                cache.record(num_tokens, num_cached)
            entry = ScheduledSeq(seq, num_cached, n)
            (decodes if entry.is_decode else prefills).append(entry)
            budget -= n
        return budget

    def update(self, output: SchedulerOutput, sampled: Mapping[int, int]) -> list[Sequence]:
        """Apply a finished step: advance `num_computed_tokens`, append each sampled token
        (`sampled`: seq_id -> token for every entry with `sample`), cache newly full blocks.

        Sequences that reach `max_tokens` are finished here (calling `finish` again is a
        no-op), so KV stays bounded even if the engine misses a stop; they are returned.
        If the model step failed, abort its sequences and call `update(output, {})`: the step
        is released and the next `schedule()` may run.
        """
        if output is not self._inflight:
            if not output.scheduled:
                return []
            raise RuntimeError("update() got a SchedulerOutput that is not the step in flight")
        entries = output.scheduled + output.forked if output.forked else output.scheduled
        num_sampled = 0
        missing: list[int] = []
        for e in entries:
            if e.sample:
                if e.seq.seq_id in sampled:
                    num_sampled += 1
                elif e.seq.status is _RUNNING:
                    missing.append(e.seq.seq_id)
        if missing:
            raise ValueError(f"no sampled token for sequences {sorted(missing)}")
        if num_sampled != len(sampled):
            sampling = {e.seq.seq_id for e in entries if e.sample}
            unexpected = sorted(sid for sid in sampled if sid not in sampling)
            raise ValueError(f"sampled tokens for sequences that were not sampling: {unexpected}")
        self._inflight = None
        cache = self.pool.prefix_cache
        bs = self.block_size
        finished: list[Sequence] = []
        for e in entries:
            seq = e.seq
            if seq.status is not _RUNNING:  # aborted while the step ran
                continue
            computed = e.start + e.num_new_tokens
            seq.num_computed_tokens = computed
            if cache is not None and computed // bs > seq.num_registered_blocks:
                self._register_full_blocks(seq)
            if e.sample:
                # Sequence.append_token, inlined: this loop runs once per sequence per step.
                token = sampled[seq.seq_id]
                out_ids = seq.output_token_ids
                out_ids.append(token)
                seq.all_token_ids.append(token)
                if len(out_ids) >= seq.max_tokens:
                    self._release(seq)
                    finished.append(seq)
        return finished

    def _register_full_blocks(self, seq: Sequence) -> None:
        cache = self.pool.prefix_cache
        assert cache is not None
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        hashes = seq.block_hashes
        tokens = seq.all_token_ids
        if len(hashes) < full:
            extend_block_hashes(hashes, tokens, bs, full, seq.extra_key, cache.hash_fn)
        table = seq.block_table
        ref = seq.cache_parent_ref
        for i in range(seq.num_registered_blocks, full):
            if ref is None:  # after a collision nothing further down this chain is findable
                break
            ref = cache.insert(
                table[i], hashes[i], ref, tokens[i * bs : (i + 1) * bs], seq.extra_key
            )
        seq.cache_parent_ref = ref
        seq.num_registered_blocks = full

    # -- observability --------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        """A snapshot for `/stats` (see `headroom.contract.stats`)."""
        pool = self.pool
        cache = pool.prefix_cache
        return SchedulerStats(
            kv=KVBlockStats(
                block_size=self.block_size,
                capacity=pool.num_blocks,
                free=pool.num_free,
                used=pool.num_used,
                cached=pool.num_cached,
                bytes_per_token=self.config.bytes_per_token,
            ),
            prefix_cache=PrefixCacheStats(
                enabled=cache is not None,
                queries_tokens_total=cache.queries_tokens_total if cache else 0,
                hits_tokens_total=cache.hits_tokens_total if cache else 0,
            ),
            requests=RequestStats(running=len(self.running), waiting=len(self.waiting)),
            preemptions_total=self.preemptions_total,
            steps_total=self.steps_total,
            last_step_schedule_seconds=self.last_step_schedule_seconds,
        )
