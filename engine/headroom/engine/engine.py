"""The synchronous engine: continuous batching of the scheduler's steps through the model.

    engine = Engine.from_config(EngineConfig(model="tiny"))
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

Streaming use (what `AsyncEngine` does on its thread): `add_request(...)` then `step()` until
`has_unfinished()` is False; each `step()` returns one `RequestOutput` of deltas per request
that produced something (see `headroom.engine.outputs`). A step is: schedule, apply
copy-on-write block copies, run the model, sample one token per sampling sequence (forking
n > 1 children right after the parent's prompt prefill, each child sampling its own first
token from the shared logits), `Scheduler.update`, then stop checks (stop token ids, EOS unless
`ignore_eos`, stop strings, max_tokens), which finish sequences and free their blocks.

A step that raises (the model, the block copies, sampling) fails only its own requests: they
are aborted, their blocks freed, the scheduler's step closed, and `step()` raises `StepFailed`
naming them; requests that were waiting go on. A request whose own decoding raises fails
alone, after the step, the same way. Either way the next `step()` runs as usual.

Not thread-safe: one thread drives an `Engine` (`AsyncEngine` owns that thread).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import cast

import torch

from headroom.contract.stats import (
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    Histogram,
    StatsSnapshot,
)
from headroom.engine.attention import select_backend
from headroom.engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from headroom.engine.errors import RequestFailed, RequestRejected
from headroom.engine.model.loader import LoadedModel, load_model
from headroom.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from headroom.engine.model_runner import ModelRunner, kv_bytes_per_token
from headroom.engine.outputs import CompletionOutput, FinishReason, RequestOutput
from headroom.engine.sampling import SamplingParams, completion_seed, make_generator, sample_rows
from headroom.engine.scheduled import SchedulerOutput
from headroom.engine.scheduler import Scheduler, SchedulerConfig
from headroom.engine.sequence import Sequence
from headroom.engine.validation import check_prompt, resolve_max_tokens

log = logging.getLogger(__name__)


class HistogramAccumulator:
    """Observations into fixed buckets, exported as the cumulative `stats.Histogram`."""

    __slots__ = ("_buckets", "_counts", "_sum", "_total")

    def __init__(self, buckets: Seq[float]) -> None:
        self._buckets = tuple(buckets)
        self._counts = [0] * len(self._buckets)
        self._sum = 0.0
        self._total = 0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self._buckets):
            if value <= upper:
                self._counts[i] += 1
                break
        self._sum += value
        self._total += 1

    def snapshot(self) -> Histogram:
        cumulative, running = [], 0
        for c in self._counts:
            running += c
            cumulative.append(running)
        return Histogram(
            buckets=list(self._buckets), counts=cumulative, sum=self._sum, count=self._total
        )


@dataclass(slots=True, eq=False)
class _Completion:
    index: int
    seq_id: int
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_tokens: int = 0
    emitted_text: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seed: int
    completions: list[_Completion] = field(default_factory=list)
    forked: bool = False
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return len(self.completions) == self.params.n and all(
            c.finish_reason is not None for c in self.completions
        )


class StepFailed(RuntimeError):
    """Some requests of a step failed and were aborted (blocks freed); `outputs` are the deltas
    of the requests that did progress, `failures` the error of each failed request."""

    def __init__(
        self,
        cause: BaseException,
        failures: dict[str, RequestFailed],
        outputs: list[RequestOutput],
        whole_step: bool,
    ) -> None:
        what = "model step" if whole_step else "decoding"
        super().__init__(
            f"{what} failed for {len(failures)} request(s): {type(cause).__name__}: {cause}"
        )
        self.cause = cause
        self.failures = failures
        self.outputs = outputs
        self.whole_step = whole_step


class Engine:
    """Model + scheduler + sampler; see the module docstring for the step."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        runner: ModelRunner,
        scheduler: Scheduler,
    ) -> None:
        self.config = config
        self.loaded = loaded
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_model_len = scheduler.config.max_model_len
        self._eos = frozenset(loaded.tokenizer.eos_token_ids) | frozenset(
            loaded.config.eos_token_ids
        )
        self._vocab = loaded.config.vocab_size
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, tuple[_Request, _Completion]] = {}
        self._seed_rng = random.Random(config.seed)
        self._ttft = HistogramAccumulator(TTFT_BUCKETS_S)
        self._tpot = HistogramAccumulator(TPOT_BUCKETS_S)
        self.instance_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.requests_finished_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Load the model, allocate the KV pool and build the scheduler."""
        device = _resolve_device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config.model, config.dtype, device)
        backend = select_backend(config.attention_backend, device)
        cfg = loaded.config
        per_token = kv_bytes_per_token(cfg, loaded.dtype, config.kv_cache_dtype)
        per_block = per_token * config.block_size
        num_blocks = config.num_blocks
        if num_blocks is None:
            memory = config.kv_cache_memory_bytes or _default_kv_bytes(device)
            num_blocks = memory // per_block
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes {memory} holds no block "
                    f"({per_block} bytes per block of {config.block_size} tokens)"
                )
        max_len = config.max_model_len or cfg.max_position_embeddings
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        window = cfg.min_sliding_window
        sliding_ok = getattr(backend, "supports_sliding_window", False)
        if window is not None and not sliding_ok and max_len > window:
            log.info(
                "capping max_model_len to the sliding window",
                extra={"window": window, "backend": backend.name},
            )
            max_len = window
        sched_cfg = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_model_len=max_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            watermark=config.watermark,
            bytes_per_token=per_token,
        )
        runner = ModelRunner(
            loaded.model, backend, num_blocks, config.block_size, config.kv_cache_dtype, device
        )
        return cls(config, loaded, runner, Scheduler(sched_cfg))

    # -- requests ---------------------------------------------------------------------------

    def encode(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of a prompt given as text or ids."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def check_request(
        self, prompt_token_ids: Seq[int], max_tokens: int | None, *, where: str = "prompt"
    ) -> int:
        """Validate a request as `add_request` will, before queueing anything; returns the
        output budget (`max_tokens`, or all the room left). Raises `RequestRejected`."""
        check_prompt(prompt_token_ids, self._vocab, where=where)
        return resolve_max_tokens(
            len(prompt_token_ids), max_tokens, self.max_model_len, where=where
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises `RequestRejected` (with the reason) if it cannot be served."""
        if request_id in self._requests:
            raise RequestRejected(f"request id {request_id!r} is already in flight")
        ids = self.encode(prompt)
        check_prompt(ids, self._vocab)
        seed = self._seed_rng.getrandbits(63) if params.seed is None else params.seed
        req = _Request(request_id, ids, params, arrival_time or time.time(), seed)
        seq = Sequence.new(request_id, ids, params.max_tokens, extra_key=self.model_name)
        self.scheduler.add(seq)  # raises RequestRejected
        self._attach(req, seq, 0)
        self._requests[request_id] = req
        self.prompt_tokens_total += len(ids)

    def _attach(self, req: _Request, seq: Sequence, index: int) -> None:
        gen = None
        if not req.params.greedy:
            gen = make_generator(completion_seed(req.seed, index))
        comp = _Completion(
            index, seq.seq_id, gen, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids)
        )
        req.completions.append(comp)
        self._by_seq[seq.seq_id] = (req, comp)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request at once, freeing its blocks; its final output (None if unknown)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort_request(request_id)
        now = time.time()
        changed = []
        for comp in req.completions:
            self._by_seq.pop(comp.seq_id, None)
            if comp.finish_reason is None:
                comp.finish_reason = "abort"
                changed.append(comp)
        for index in range(len(req.completions), req.params.n):  # children never forked
            changed.append(
                _Completion(
                    index,
                    -1,
                    None,
                    IncrementalDetokenizer(self.tokenizer, []),
                    finish_reason="abort",
                )
            )
        req.finished_time = now
        self.requests_finished_total += 1
        return self._output(req, changed, finished=True)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step through the model; the deltas it produced, per request.

        Raises `StepFailed` when requests failed (see the module docstring); the engine is
        consistent afterwards and the next call runs the next step."""
        sched = self.scheduler
        out = sched.schedule()
        if out.is_empty:
            return []
        try:
            sampled = self._run_model(out)
        except Exception as exc:
            # The step's own requests go; the scheduler's step is closed with nothing sampled
            # (update skips the aborted sequences), so the next schedule() may run.
            failed = {e.seq.request_id for e in out.scheduled}
            failures = self._fail(failed, exc)
            sched.update(out, {})
            raise StepFailed(exc, failures, [], whole_step=True) from exc
        sched.update(out, sampled)
        now = time.time()
        touched: dict[str, tuple[_Request, list[_Completion]]] = {}
        broken: dict[str, Exception] = {}
        for seq_id, token in sampled.items():
            req, comp = self._by_seq[seq_id]
            if req.request_id in broken:
                continue
            try:
                self._on_token(req, comp, token, now)
            except Exception as exc:  # a tokenizer that cannot decode this token, say
                broken[req.request_id] = exc
                continue
            touched.setdefault(req.request_id, (req, []))[1].append(comp)
        results = []
        for req, comps in touched.values():
            if req.request_id in broken:
                continue
            finished = req.finished
            if finished:
                self._retire(req, now)
            results.append(self._output(req, comps, finished))
        if broken:
            failures = {rid: self._fail({rid}, exc)[rid] for rid, exc in broken.items()}
            first = next(iter(broken.values()))
            raise StepFailed(first, failures, results, whole_step=False) from first
        return results

    def _run_model(self, out: SchedulerOutput) -> dict[int, int]:
        """Block copies, the forward pass, forks and sampling: seq_id -> sampled token."""
        sched = self.scheduler
        self.runner.copy_blocks(out.blocks_to_copy)
        logits, entries = self.runner.execute(out)
        rows: list[int] = []
        params: list[SamplingParams] = []
        gens: list[torch.Generator | None] = []
        owners: list[int] = []
        for row, entry in enumerate(entries):
            req, comp = self._by_seq[entry.seq.seq_id]
            rows.append(row)
            params.append(req.params)
            gens.append(comp.generator)
            owners.append(comp.seq_id)
            if req.first_token_time is None:
                req.num_cached_tokens = entry.seq.num_cached_tokens
            if req.params.n > 1 and not req.forked:
                req.forked = True
                for child in sched.fork(entry.seq.seq_id, req.params.n - 1):
                    self._attach(req, child, len(req.completions))
                    _, child_comp = self._by_seq[child.seq_id]
                    rows.append(row)
                    params.append(req.params)
                    gens.append(child_comp.generator)
                    owners.append(child.seq_id)
        picked = logits.index_select(0, torch.tensor(rows, dtype=torch.int64)) if rows else logits
        tokens = sample_rows(picked, params, gens)
        return dict(zip(owners, tokens, strict=True))

    def _fail(self, request_ids: set[str], exc: BaseException) -> dict[str, RequestFailed]:
        """Abort `request_ids` (freeing their blocks) and say why, one error per request."""
        log.error(
            "requests failed in the engine",
            extra={"requests": sorted(request_ids), "error": f"{type(exc).__name__}: {exc}"},
        )
        failures = {}
        for rid in request_ids:
            if self.abort(rid) is not None:
                failures[rid] = RequestFailed(rid, exc)
        return failures

    def _on_token(self, req: _Request, comp: _Completion, token: int, now: float) -> None:
        params = req.params
        comp.token_ids.append(token)
        self.generation_tokens_total += 1
        if comp.first_token_time is None:
            comp.first_token_time = now
            if req.first_token_time is None:
                req.first_token_time = now
                self._ttft.observe(now - req.arrival_time)
        comp.last_token_time = now
        if token in params.stop_token_ids or (not params.ignore_eos and token in self._eos):
            self._finish(comp, "stop", token)
            return
        delta = comp.detok.add(token)
        if delta:
            self._append_text(req, comp, delta)
            if comp.finish_reason is not None:
                return
        if len(comp.token_ids) >= params.max_tokens:
            self._finish(comp, "length", None)

    def _append_text(self, req: _Request, comp: _Completion, delta: str) -> None:
        stops = req.params.stop
        old = len(comp.text)
        comp.text += delta
        if not stops:
            return
        window_start = max(0, old - req.params.max_stop_len + 1)
        hit: tuple[int, str] | None = None
        for s in stops:
            idx = comp.text.find(s, window_start)
            if idx >= 0 and (hit is None or idx < hit[0]):
                hit = (idx, s)
        if hit is not None:
            comp.text = comp.text[: hit[0]]
            self._finish(comp, "stop", hit[1])

    def _finish(
        self, comp: _Completion, reason: FinishReason, stop_reason: str | int | None
    ) -> None:
        if not isinstance(stop_reason, str):  # a stop string already cut the text
            tail = comp.detok.flush()
            if tail:
                comp.text += tail
        comp.finish_reason = reason
        comp.stop_reason = stop_reason
        self.scheduler.finish(comp.seq_id)  # a no-op when update() already released it
        self._by_seq.pop(comp.seq_id, None)
        if comp.first_token_time is not None and len(comp.token_ids) > 1:
            assert comp.last_token_time is not None
            if comp.index == 0:
                tpot = (comp.last_token_time - comp.first_token_time) / (len(comp.token_ids) - 1)
                self._tpot.observe(tpot)

    def _retire(self, req: _Request, now: float) -> None:
        req.finished_time = now
        self._requests.pop(req.request_id, None)
        self.requests_finished_total += 1

    def _output(self, req: _Request, comps: list[_Completion], finished: bool) -> RequestOutput:
        outs = []
        hold = 0 if not req.params.stop else req.params.max_stop_len - 1
        for comp in sorted(comps, key=lambda c: c.index):
            end = (
                len(comp.text)
                if comp.finish_reason is not None
                else max(comp.emitted_text, len(comp.text) - hold)
            )
            text = comp.text[comp.emitted_text : end]
            new_ids = comp.token_ids[comp.emitted_tokens :]
            comp.emitted_text = end
            comp.emitted_tokens = len(comp.token_ids)
            outs.append(
                CompletionOutput.model_construct(
                    index=comp.index,
                    text=text,
                    token_ids=new_ids,
                    cumulative_text=comp.text[:end],
                    finish_reason=comp.finish_reason,
                    stop_reason=comp.stop_reason,
                )
            )
        # model_construct: these are the engine's own values, and validating a long prompt's
        # ids on every step of every request would cost more than the step's bookkeeping.
        return RequestOutput.model_construct(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=finished,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
            num_cached_tokens=req.num_cached_tokens,
        )

    # -- batch API --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one merged output per prompt, in order (text and
        token_ids are the whole completions)."""
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        prompt_list = cast(list[str | Seq[int]], list(prompts))
        if len(plist) != len(prompt_list):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        base = uuid.uuid4().hex[:8]
        ids = [f"gen-{base}-{i}" for i in range(len(prompts))]
        merged: dict[str, RequestOutput] = {}
        try:
            for rid, prompt, p in zip(ids, prompt_list, plist, strict=True):
                self.add_request(rid, prompt, p)
            while any(rid not in merged or not merged[rid].finished for rid in ids):
                if not self.has_unfinished():
                    raise RuntimeError("engine stopped with requests unfinished")
                for out in self.step():
                    if out.request_id in merged:
                        _merge(merged[out.request_id], out)
                    elif out.request_id in ids:
                        merged[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        return [merged[rid] for rid in ids]

    # -- observability ----------------------------------------------------------------------

    def stats(self) -> StatsSnapshot:
        """The `/stats` snapshot: scheduler state plus identity, totals and latency histograms."""
        s = self.scheduler.stats()
        return StatsSnapshot(
            model=self.model_name,
            instance_id=self.instance_id,
            started_at=self.started_at,
            time=time.time(),
            kv=s.kv,
            prefix_cache=s.prefix_cache,
            requests=s.requests,
            preemptions_total=s.preemptions_total,
            steps_total=s.steps_total,
            requests_finished_total=self.requests_finished_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            time_to_first_token_seconds=self._ttft.snapshot(),
            time_per_output_token_seconds=self._tpot.snapshot(),
        )


def _merge(into: RequestOutput, delta: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for c in delta.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            into.outputs.append(c.model_copy())
            continue
        prev.text += c.text
        prev.token_ids.extend(c.token_ids)
        prev.cumulative_text = c.cumulative_text
        prev.finish_reason = c.finish_reason
        prev.stop_reason = c.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = delta.finished
    into.first_token_time = delta.first_token_time
    into.finished_time = delta.finished_time
    into.num_cached_tokens = delta.num_cached_tokens


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but torch sees no CUDA GPU")
    return dev


def _default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)  # headroom.contract.budget sizes production pods; this is a fallback
    return DEFAULT_CPU_KV_BYTES


__all__ = [
    "Engine",
    "EngineConfig",
    "RequestFailed",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "StepFailed",
]
