"""Continuous batching over the KV manager: admission, chunked prefill, decode, preemption.

One step, `schedule()`:
1. Running sequences, oldest admission first, each get their next tokens: one for a decode,
   a chunk of the prompt (bounded by what the per-step token budget has left) for a prefill;
   every decode comes before the one prefill that may still be running. A sequence whose
   tokens find no room, even after evicting cached prefix blocks, preempts the most recently
   admitted sequence by recompute (its blocks freed, itself requeued at the front of the
   waiting queue) until it fits; a prefill chunk shrinks to the room there is before
   preempting anyone. KV never runs out: at worst the oldest sequence runs alone, and `add`
   rejects what cannot fit alone.
2. Waiting sequences are admitted first come, first served, each from its computed prefix
   (see `KVManager.computed_blocks`), while the budget, `max_num_seqs` and the blocks allow:
   `headroom.contract.admission.fits`, which keeps `watermark` of the pool for running decodes.

The engine runs the model on the `SchedulerOutput`, then calls `update` with the sampled tokens:
schedule -> run -> update, one way. The scheduler never touches a block itself.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from headroom.contract.admission import fits, watermark_blocks
from headroom.engine.config import EngineConfig
from headroom.engine.errors import RequestRejected
from headroom.engine.kv_manager import KVManager
from headroom.engine.prefix_cache import PrefixCache
from headroom.engine.scheduled import ScheduledSeq, SchedulerOutput
from headroom.engine.sequence import Sequence, SequenceStatus
from headroom.engine.validation import resolve_max_tokens

_WAITING = SequenceStatus.WAITING
_RUNNING = SequenceStatus.RUNNING


class Scheduler:
    """Owns every unfinished sequence and, through the KV manager, their blocks."""

    def __init__(self, config: EngineConfig, kv: KVManager | None = None) -> None:
        if config.num_blocks is None or config.max_model_len is None:
            raise ValueError(
                "the scheduler needs num_blocks and max_model_len (EngineConfig.sized)"
            )
        self.config = config
        self.num_blocks, self.max_model_len = config.num_blocks, config.max_model_len
        if kv is None:
            cache = PrefixCache(self.num_blocks) if config.enable_prefix_caching else None
            kv = KVManager(self.num_blocks, config.block_size, cache)
        self.kv = kv
        # First come, first served. A sequence finished while it waits (its client went away)
        # stays until it reaches the front: `deque.remove` scanned the queue ahead of it, on the
        # engine thread, every stream paused (3.5 s for 4,096 behind 28,672). Count with `seqs`.
        self.waiting: deque[Sequence] = deque()
        # Admission order: the tail is the most recently admitted, the first to be preempted.
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence, waiting or running
        self._inflight: SchedulerOutput | None = None
        self._watermark_blocks = watermark_blocks(config.watermark, self.num_blocks)
        self.preemptions_total = self.steps_total = 0
        self.last_step_schedule_seconds = 0.0

    def add(self, seq: Sequence) -> None:
        """Queue a fresh sequence; raises `RequestRejected` if it could never be served."""
        bs = self.config.block_size
        if seq.seq_id in self.seqs:
            raise RequestRejected(f"sequence {seq.seq_id} was already added")
        if seq.status is not _WAITING or seq.block_table or seq.num_computed_tokens:
            raise RequestRejected(f"sequence {seq.seq_id} is {seq.status.value}, not fresh")
        if not seq.prompt_token_ids:
            raise RequestRejected("the prompt is empty", param="prompt", code="empty_prompt")
        prompt, out = seq.num_prompt_tokens, seq.max_tokens
        resolve_max_tokens(prompt, out, self.max_model_len)
        # The last sampled token is never fed back (the sequence finishes as it is sampled), so
        # at most prompt + max_tokens - 1 positions ever hold KV, recompute after preemption too.
        blocks = -(-(prompt + out - 1) // bs)
        if blocks > self.num_blocks:
            raise RequestRejected(
                f"prompt {prompt} + max_tokens {out} needs the KV of {prompt + out - 1} tokens: "
                f"{blocks} KV blocks of {bs} tokens but the whole pool holds {self.num_blocks}",
                param="max_tokens",
                code="exceeds_kv_pool",
            )
        self.waiting.append(seq)
        self.seqs[seq.seq_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def finish(self, seq_id: int) -> bool:
        """End a sequence at once, waiting or running (a stop, or the client went away): its
        blocks are released and full ones stay cached. False if unknown or already finished."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return False
        if seq.status is _RUNNING:
            self.running.remove(seq)
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = _WAITING
        self.waiting.appendleft(seq)
        self.preemptions_total += 1

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring); allocates the blocks it needs."""
        if self._inflight is not None:
            raise RuntimeError("schedule() called again before update() for the previous step")
        t0 = time.perf_counter()
        out = SchedulerOutput()
        running, max_seqs = self.running, self.config.max_num_seqs
        budget = self.config.max_num_batched_tokens
        # Running is every decode, then at most one prefill, last: admission stops at the first
        # prompt the budget cuts short, a prefill chunk the blocks cut short leaves none for an
        # admission, and preemption takes from the tail. So each sequence in turn may take what
        # the budget has left without starving a decode.
        i = 0
        while i < len(running) and i < max_seqs and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            n = min(seq.num_tokens - computed, budget)
            while not (m := self.kv.allocate_slots(seq, n, out.blocks_to_copy)):
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is _WAITING:
                break  # `seq` itself was preempted: nothing behind it can run either
            out.add(ScheduledSeq(seq, computed, m))
            budget -= m
            i += 1
        # Admitting right after a preemption would only thrash, unless nothing else can run.
        if self.waiting and (not out.preempted or out.is_empty):
            self._admit(budget, out)
        if not out.is_empty:
            self._inflight = out
            self.steps_total += 1
        self.last_step_schedule_seconds = time.perf_counter() - t0
        return out

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        kv, waiting, running = self.kv, self.waiting, self.running
        max_seqs, reserve = self.config.max_num_seqs, self._watermark_blocks
        # Every admission takes a block at least: when not even one fits (or no slot is free),
        # stop before the prefix walk, as long as the head's prompt, redone and thrown away at
        # every step the queue is blocked (3.4 ms of a 3.8 ms step at a 32k-token prefix).
        while waiting and budget > 0 and fits(kv.num_available, 1, reserve, len(running), max_seqs):
            seq = waiting[0]
            if seq.status is not _WAITING:  # finished while it waited
                waiting.popleft()
                continue
            prefix = kv.computed_blocks(seq)
            if prefix is None:
                break  # its first sibling is still computing their prompt
            blocks, computed = prefix
            n = min(seq.num_tokens - computed, budget)
            need = kv.blocks_to_admit(blocks, computed, n)
            if not fits(kv.num_available, need, reserve, len(running), max_seqs):
                break
            waiting.popleft()
            kv.admit(seq, blocks, computed, n, out.blocks_to_copy)
            seq.status = _RUNNING
            running.append(seq)
            out.add(ScheduledSeq(seq, computed, n))
            budget -= n

    def update(self, output: SchedulerOutput, sampled: Mapping[int, int]) -> list[Sequence]:
        """Apply a finished step: advance `num_computed_tokens`, append each sampled token
        (`sampled`: seq_id -> token for every entry with `sample`), cache newly full blocks.

        Sequences that reach `max_tokens` are finished here (calling `finish` again is a
        no-op), so KV stays bounded even if the engine misses a stop; they are returned.
        If the model step failed, abort its sequences and call `update(output, {})`: the step
        is released and the next `schedule()` may run.
        """
        if output is not self._inflight:
            if output.is_empty:
                return []
            raise RuntimeError("update() got a SchedulerOutput that is not the step in flight")
        entries = output.scheduled
        sampling = {e.seq.seq_id: e.seq for e in entries if e.sample}
        running = {i for i, s in sampling.items() if s.status is _RUNNING}  # not aborted
        if missing := sorted(running - sampled.keys()):
            raise ValueError(f"no sampled token for sequences {missing}")
        if unexpected := sorted(sampled.keys() - sampling.keys()):
            raise ValueError(f"sampled tokens for sequences that were not sampling: {unexpected}")
        self._inflight = None
        finished: list[Sequence] = []
        for e in entries:
            seq = e.seq
            if seq.status is not _RUNNING:  # aborted while the step ran
                continue
            seq.num_computed_tokens = e.start + e.num_new_tokens
            self.kv.cache_blocks(seq)
            if e.sample:
                token = sampled[seq.seq_id]
                seq.output_token_ids.append(token)
                seq.all_token_ids.append(token)
                if len(seq.output_token_ids) >= seq.max_tokens:
                    self.finish(seq.seq_id)
                    finished.append(seq)
        return finished
