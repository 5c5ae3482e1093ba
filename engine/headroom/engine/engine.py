"""The synchronous engine: continuous batching of the scheduler's steps through the model.

    engine = Engine.from_config(EngineConfig(model="tiny"))
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

Streaming use (what `AsyncEngine` does on its thread): `add_request(...)` then `step()` until
`has_unfinished()` is False; each `step()` returns one `RequestOutput` of deltas per request
that produced something (see `headroom.engine.outputs`).

A request with `n` completions is fanned out into `n` sequences as it arrives
(`headroom.engine.requests`), so a step runs one way: schedule, run (block copies, the forward
pass, one sampled token per sampling sequence), update the scheduler, then per token the
detokenization and stop checks (`headroom.engine.stops`), which finish completions and free
their blocks. What fails is isolated as `headroom.engine.failures` says; what is counted is in
`headroom.engine.stats`.

Not thread-safe: one thread drives an `Engine` (`AsyncEngine` owns that thread).
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Sequence as Seq
from typing import cast

import torch

from headroom.contract.budget import kv_bytes_per_token, kv_cache_dtype
from headroom.contract.clock import steady_time
from headroom.contract.stats import StatsSnapshot
from headroom.engine.attention import select_backend
from headroom.engine.attention.kv_scales import load_model_scales
from headroom.engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from headroom.engine.errors import EngineConfigError, RequestFailed, RequestRejected
from headroom.engine.failures import StepFailed, fail_requests
from headroom.engine.model.loader import LoadedModel, load_model
from headroom.engine.model.tokenizer import Tokenizer
from headroom.engine.model_runner import ModelRunner
from headroom.engine.outputs import RequestOutput
from headroom.engine.requests import Completion, Request, fan_out, merge
from headroom.engine.sampling import SamplingParams, sample_rows
from headroom.engine.scheduled import SchedulerOutput
from headroom.engine.scheduler import Scheduler
from headroom.engine.stats import EngineStats
from headroom.engine.stops import add_token
from headroom.engine.validation import check_prompt, resolve_max_tokens

log = logging.getLogger(__name__)


class Engine:
    """Model + scheduler + sampler; see the module docstring for the step."""

    def __init__(
        self, config: EngineConfig, loaded: LoadedModel, runner: ModelRunner, scheduler: Scheduler
    ) -> None:
        self.config = config
        self.loaded = loaded
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_model_len = scheduler.max_model_len
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, str(loaded.dtype))
        self.bytes_per_token = kv_bytes_per_token(loaded.config, self.kv_dtype)
        self._eos = frozenset(loaded.tokenizer.eos_token_ids) | frozenset(
            loaded.config.eos_token_ids
        )
        self._vocab = loaded.config.vocab_size
        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, tuple[Request, Completion]] = {}
        self._seed_rng = random.Random(config.seed)
        self.counters = EngineStats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Load the model, size and allocate the KV pool, build the scheduler."""
        device = _resolve_device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config.model, config.dtype, device)
        cfg = loaded.config
        backend = select_backend(
            config.attention_backend, device, cfg.head_dim, config.block_size, loaded.dtype
        )
        storage = kv_cache_dtype(config.kv_cache_dtype, str(loaded.dtype))
        per_block = kv_bytes_per_token(cfg, storage) * config.block_size
        num_blocks = config.num_blocks
        if num_blocks is None:
            memory = config.kv_cache_memory_bytes or _default_kv_bytes(device)
            num_blocks = memory // per_block
            if num_blocks < 1:
                raise EngineConfigError(
                    f"kv_cache_memory_bytes {memory} holds no block "
                    f"({per_block} bytes per block of {config.block_size} tokens)"
                )
        max_len = config.max_model_len or cfg.max_position_embeddings
        if max_len > cfg.max_position_embeddings:
            raise EngineConfigError(
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
        max_len = _fit_pool(max_len, config, num_blocks, per_block)
        sized = config.sized(num_blocks, max_len)
        runner = ModelRunner(
            loaded.model, backend, num_blocks, config.block_size, config.kv_cache_dtype, device
        )
        scales = load_model_scales(config.model, runner.caches)  # kv-check --calibrate's file
        if scales is not None:
            log.info("static fp8 KV scales loaded", extra={"path": str(scales)})
        return cls(sized, loaded, runner, Scheduler(sized))

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
        req = Request(request_id, ids, params, arrival_time or steady_time())
        seqs = fan_out(req, seed, self.tokenizer, self.model_name)
        for seq in seqs:  # the first raises RequestRejected, if any: siblings are its size
            self.scheduler.add(seq)
        for seq, comp in zip(seqs, req.completions, strict=True):
            self._by_seq[seq.seq_id] = (req, comp)
        self._requests[request_id] = req
        self.counters.arrived(len(ids))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request at once, freeing its blocks; its final output (None if unknown)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        changed = []
        for comp in req.completions:
            self.scheduler.finish(comp.seq_id)
            self._by_seq.pop(comp.seq_id, None)
            if comp.finish_reason is None:
                comp.finish_reason = "abort"
                changed.append(comp)
        req.finished_time = steady_time()
        self.counters.requests_finished_total += 1
        return req.output(changed, finished=True)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step through the model; the deltas it produced, per request.

        Raises `StepFailed` when requests failed (see `headroom.engine.failures`); the engine
        is consistent afterwards and the next call runs the next step."""
        sched = self.scheduler
        out = sched.schedule()
        if out.is_empty:
            return []
        try:
            sampled = self._run_model(out)
        except Exception as exc:
            # The step's own requests go; the scheduler's step is closed with nothing sampled
            # (update skips the aborted sequences), so the next schedule() may run.
            failures = fail_requests(self.abort, (e.seq.request_id for e in out.scheduled), exc)
            sched.update(out, {})
            raise StepFailed(exc, failures, [], whole_step=True) from exc
        sched.update(out, sampled)
        return self._postprocess(sampled)

    def _run_model(self, out: SchedulerOutput) -> dict[int, int]:
        """Block copies, the forward pass and sampling: seq_id -> sampled token."""
        self.runner.copy_blocks(out.blocks_to_copy)
        logits, entries = self.runner.execute(out)
        owners = [self._by_seq[e.seq.seq_id] for e in entries]
        for (req, _), e in zip(owners, entries, strict=True):
            if req.first_token_time is None:
                req.num_cached_tokens = e.seq.num_cached_tokens
        params = [req.params for req, _ in owners]
        tokens = sample_rows(logits, params, [comp.generator for _, comp in owners])
        return {comp.seq_id: t for (_, comp), t in zip(owners, tokens, strict=True)}

    def _postprocess(self, sampled: dict[int, int]) -> list[RequestOutput]:
        """Detokenize and check stops per token; a request whose decoding raises fails alone."""
        now = steady_time()
        touched: dict[str, tuple[Request, list[Completion]]] = {}
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
            if req.finished:
                req.finished_time = now
                self._requests.pop(req.request_id, None)
                self.counters.requests_finished_total += 1
            results.append(req.output(comps, req.finished))
        if broken:
            failures: dict[str, RequestFailed] = {}
            for rid, error in broken.items():
                failures.update(fail_requests(self.abort, [rid], error))
            first = next(iter(broken.values()))
            raise StepFailed(first, failures, results, whole_step=False) from first
        return results

    def _on_token(self, req: Request, comp: Completion, token: int, now: float) -> None:
        counters = self.counters
        counters.generation_tokens_total += 1
        if comp.first_token_time is None:
            comp.first_token_time = now
            if req.first_token_time is None:
                req.first_token_time = now
                counters.ttft.observe(now - req.arrival_time)
        comp.last_token_time = now
        add_token(comp, token, req.params, self._eos)
        if comp.finish_reason is None:
            return
        self.scheduler.finish(comp.seq_id)  # a no-op when update() already released it
        self._by_seq.pop(comp.seq_id, None)
        if comp.index == 0 and len(comp.token_ids) > 1:
            first = comp.first_token_time
            counters.tpot.observe((now - first) / (len(comp.token_ids) - 1))

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
                        merge(merged[out.request_id], out)
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
        return self.counters.snapshot(self.model_name, self.scheduler, self.bytes_per_token)


def _fit_pool(max_len: int, config: EngineConfig, num_blocks: int, per_block: int) -> int:
    """`max_len` if the KV pool holds one sequence that long; a default length (the model's
    limit, not a flag) is capped to the pool with a warning; an explicit one is refused, or
    every request that leaves max_tokens unset (all of `max_model_len`) would be rejected."""
    bs = config.block_size
    pool_tokens = num_blocks * bs
    if max_len <= pool_tokens:
        return max_len
    if config.max_model_len is None:
        log.warning(
            "capping max_model_len from the model's %d to the KV pool's %d tokens (%d blocks x "
            "%d); give a larger pool or an explicit max_model_len to choose",
            max_len,
            pool_tokens,
            num_blocks,
            bs,
        )
        return pool_tokens
    need = -(-max_len // bs)
    raise EngineConfigError(
        f"KV pool of {num_blocks:,} blocks x {bs} tokens = {pool_tokens:,} tokens cannot hold "
        f"one sequence of max_model_len {max_len:,} tokens, which needs {need:,} blocks; raise "
        f"--num-blocks to at least {need:,} (or --kv-cache-memory to at least "
        f"{need * per_block:,} bytes) or lower --max-model-len to {pool_tokens:,} or less"
    )


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
