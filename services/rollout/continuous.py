"""The continuous-batching engine: every step runs one packed forward pass over the new tokens of every
running sequence, and each sequence keeps its keys/values, so nothing is encoded twice.

Where the time went before (transformers ``generate``): every turn re-encoded the whole episode, the 8
episodes of a group each encoded the same opening, and a batch ran until its longest member stopped.
Here:

* **Continuous batching.** A sequence that stops leaves at once; a new request joins at the next step.
  A step feeds one token per decoding sequence plus up to ``prefill_chunk`` prompt tokens of sequences
  still reading their prompt (chunked prefill), through the linear layers as one matrix.
* **KV reuse.** A finished turn's cache stays resident. The next turn of the same episode extends it
  (its prompt starts with everything the cache holds), so only the new observation tokens are encoded.
  A request whose prompt shares a long prefix with a resident cache (the other episodes of a group, the
  system prompt of a task) copies that prefix's keys/values instead of recomputing them; a request that
  would share a prefix another request is encoding right now waits for it, then copies.
* **Sampled tokens only.** The LM head runs on the one row per sequence that samples.

Weights: an update stops admission, lets the running turns finish, swaps the weights and drops every
cache (its keys/values belong to the old policy), so each turn comes from one policy version.
Behaviour logprobs are ``log_softmax(logits / T)`` of the sampled token, the trainer's formula
(``shared.lm.token_logprobs``); greedy requests (T = 0) report T = 1.
"""

from __future__ import annotations

import queue
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch

from services.rollout.engine import STOP, Generation, QueuedEngine, Request, WeightUpdate
from shared.lm import PackedLM, fuse_projections
from shared.model import load_model, load_weights_into

log = structlog.get_logger()

MIN_SHARED_PREFIX = 16
"""Shorter common prefixes are recomputed rather than copied (not worth a cache lookup)."""


class SequenceCache:
    """Keys and values of one token sequence, every layer, computed by one policy version."""

    def __init__(self, lm: PackedLM, capacity: int, version: int) -> None:
        self.kv = torch.empty((lm.num_layers, 2, capacity, lm.num_kv_heads, lm.head_dim), dtype=lm.dtype)
        self.tokens = np.zeros(capacity, dtype=np.int64)
        self.length = 0  # tokens whose keys/values are in ``kv``
        self.version = version
        self.busy = False  # owned by a running request (it may grow); others may still copy its prefix
        self.last_used = time.monotonic()

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]

    def reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        kv = torch.empty((*self.kv.shape[:2], capacity, *self.kv.shape[3:]), dtype=self.kv.dtype)
        kv[:, :, : self.length] = self.kv[:, :, : self.length]
        tokens = np.zeros(capacity, dtype=np.int64)
        tokens[: self.length] = self.tokens[: self.length]
        self.kv, self.tokens = kv, tokens

    def common_prefix(self, prompt: np.ndarray) -> int:
        m = min(self.length, len(prompt))
        if m == 0:
            return 0
        same = self.tokens[:m] == prompt[:m]
        return m if same.all() else int(same.argmin())

    def copy_prefix(self, lm: PackedLM, length: int, capacity: int) -> SequenceCache:
        out = SequenceCache(lm, max(capacity, length), self.version)
        out.kv[:, :, :length] = self.kv[:, :, :length]
        out.tokens[:length] = self.tokens[:length]
        out.length = length
        return out


@dataclass
class Running:
    """A request being served: its cache, the prompt tokens it has still to feed, what it sampled."""

    req: Request
    cache: SequenceCache
    to_feed: list[int]
    version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def reading_prompt(self) -> bool:
        return not self.tokens


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # tokens of prompts that requests brought
    prefilled_tokens: int = 0  # of those, tokens actually encoded (the rest came from caches)
    sampled_tokens: int = 0
    copied_prefix_tokens: int = 0
    waited_for_shared_prefix: int = 0
    fed_tokens: int = 0  # rows of every step (prompt chunks and decoded tokens): fed_tokens / steps = batch
    busy_s: float = 0.0  # time in forward passes and sampling


class ContinuousEngine(QueuedEngine):
    def __init__(self, model_path: Any, engine_id: str, stop_token_ids: list[int], *, threads: int = 1,
                 max_batch: int = 64, prefill_chunk: int = 512, cache_tokens: int = 65536,
                 max_context: int = 8192, seed: int = 0, device: str = "cpu") -> None:
        torch.set_num_threads(threads)
        self.model = load_model(model_path, device=device).eval().requires_grad_(False)
        fuse_projections(self.model)
        self.lm = PackedLM(self.model)
        self.stop_token_ids = set(stop_token_ids)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.cache_tokens = cache_tokens  # resident KV budget, in tokens (~46 KB each for SmolLM2 in fp32)
        self.max_context = max_context
        self.stats = EngineStats()
        self.generator = torch.Generator().manual_seed(zlib.crc32(f"{engine_id}/{seed}".encode()))
        self.caches: list[SequenceCache] = []
        self._start(engine_id)

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        waiting: list[Request] = []
        running: list[Running] = []
        update: WeightUpdate | None = None
        while True:
            block = not running and not waiting and update is None
            while True:  # take everything queued; sleep only when there is nothing to do
                try:
                    item = self._queue.get(block=block)
                except queue.Empty:
                    break
                block = False
                if item is STOP:
                    for r in running:
                        r.req.fail(RuntimeError("engine closed"))
                    for w in waiting:
                        w.fail(RuntimeError("engine closed"))
                    return
                if isinstance(item, WeightUpdate):
                    if update is not None:  # two updates queued: the older one is superseded
                        update.done()
                    update = item
                else:
                    waiting.append(item)
            if update is not None and not running:
                self._apply_weights(update)
                update = None
            if update is None:
                waiting = self._admit(waiting, running)
            if running:
                try:
                    self._step(running)
                except Exception as exc:  # fail what was running, keep the engine
                    log.exception("engine_step_failed")
                    for r in running:
                        r.cache.busy = False
                        self.caches = [c for c in self.caches if c is not r.cache]
                        r.req.fail(exc)
                    running.clear()

    def _apply_weights(self, update: WeightUpdate) -> None:
        try:
            load_weights_into(self.model, update.state)
        except Exception as exc:
            update.fail(exc)
            return
        self.policy_version = update.version
        self.caches.clear()  # their keys/values were computed by the old weights
        update.done()

    # ------------------------------------------------------------------ admission
    def _admit(self, waiting: list[Request], running: list[Running]) -> list[Request]:
        """Start waiting requests in arrival order while there is room; returns those still waiting."""
        still: list[Request] = []
        for req in waiting:
            if len(running) >= self.max_batch:
                still.append(req)
                continue
            if len(req.prompt) + req.max_new_tokens > self.max_context:
                req.fail(ValueError(f"prompt of {len(req.prompt)} tokens + {req.max_new_tokens} new exceeds "
                                    f"the engine's max_context {self.max_context}"))
                continue
            prompt = np.asarray(req.prompt, dtype=np.int64)
            best, shared = self._best_cache(prompt)
            # Another request is encoding a longer common prefix right now: copy it when it is done.
            if any(r.reading_prompt and _common(r.req.prompt, prompt) >= shared + MIN_SHARED_PREFIX for r in running):
                self.stats.waited_for_shared_prefix += 1
                still.append(req)
                continue
            running.append(self._start_request(req, prompt, best, shared))
        return still

    def _best_cache(self, prompt: np.ndarray) -> tuple[SequenceCache | None, int]:
        best, shared = None, 0
        for cache in self.caches:
            n = cache.common_prefix(prompt)
            # prefer a cache this request can take over (idle, wholly a prefix of the prompt): no copy
            if n > shared or (n == shared and best is not None and n == cache.length and not cache.busy):
                best, shared = cache, n
        return best, shared

    def _start_request(self, req: Request, prompt: np.ndarray, best: SequenceCache | None,
                       shared: int) -> Running:
        shared = min(shared, len(prompt) - 1)  # the last prompt token is always fed: it yields the first logits
        capacity = len(prompt) + req.max_new_tokens
        if best is not None and not best.busy and shared >= best.length - 1 and shared >= MIN_SHARED_PREFIX:
            cache = best  # the episode's previous turn: extend it in place
            cache.length = shared
            cache.reserve(capacity)
        elif best is not None and shared >= MIN_SHARED_PREFIX:
            cache = best.copy_prefix(self.lm, shared, capacity)
            self.stats.copied_prefix_tokens += shared
            self.caches.append(cache)
        else:
            shared = 0
            cache = SequenceCache(self.lm, capacity, self.policy_version)
            self.caches.append(cache)
        cache.busy = True
        cache.last_used = time.monotonic()
        self.stats.prompt_tokens += len(prompt)
        self._evict()
        return Running(req, cache, prompt[shared:].tolist(), self.policy_version)

    def _evict(self) -> None:
        """Drop least recently used idle caches beyond the resident budget."""
        total = sum(c.capacity for c in self.caches)
        if total <= self.cache_tokens:
            return
        for cache in sorted((c for c in self.caches if not c.busy), key=lambda c: c.last_used):
            self.caches.remove(cache)
            total -= cache.capacity
            if total <= self.cache_tokens:
                break

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def _step(self, running: list[Running]) -> None:
        started = time.perf_counter()
        budget = self.prefill_chunk
        feeds: list[tuple[Running, list[int]]] = []
        for r in running:
            if len(r.to_feed) == 1:
                feeds.append((r, r.to_feed))
            elif budget > 0:  # prompt chunks share the budget; decoding sequences always advance
                chunk = r.to_feed[:budget]
                budget -= len(chunk)
                feeds.append((r, chunk))
        ids = torch.tensor([t for _, chunk in feeds for t in chunk])
        positions = torch.cat([torch.arange(r.cache.length, r.cache.length + len(chunk)) for r, chunk in feeds])
        rows = np.cumsum([0] + [len(chunk) for _, chunk in feeds])
        lm = self.lm

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = []
            for (r, _), a, b in zip(feeds, rows[:-1], rows[1:], strict=True):
                kv, n0 = r.cache.kv[layer], r.cache.length
                kv[0, n0: n0 + b - a] = k[a:b]
                kv[1, n0: n0 + b - a] = v[a:b]
                out.append(lm.attention(q[a:b], kv[0, : n0 + b - a], kv[1, : n0 + b - a], n0))
            return torch.cat(out)

        hidden = lm.hidden(ids, positions, attend)
        sampling: list[tuple[Running, int]] = []
        for (r, chunk), b in zip(feeds, rows[1:], strict=True):
            cache = r.cache
            cache.tokens[cache.length: cache.length + len(chunk)] = chunk
            cache.length += len(chunk)
            r.to_feed = r.to_feed[len(chunk):]
            if r.reading_prompt:
                self.stats.prefilled_tokens += len(chunk)
            if not r.to_feed:  # the whole prompt (or the last sampled token) is in: sample the next token
                sampling.append((r, int(b) - 1))
        self.stats.steps += 1
        self.stats.fed_tokens += int(rows[-1])
        if sampling:
            self._sample(sampling, hidden)
        self.stats.busy_s += time.perf_counter() - started
        for r in [r for r, _ in sampling]:
            if self._finished(r):
                running.remove(r)

    def _sample(self, sampling: list[tuple[Running, int]], hidden: torch.Tensor) -> None:
        logits = self.lm.logits(hidden[[row for _, row in sampling]])
        temps = torch.tensor([r.req.temperature if r.req.temperature > 0 else 1.0 for r, _ in sampling])
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        greedy = torch.tensor([r.req.temperature <= 0 for r, _ in sampling])
        # inverse-CDF sampling: one uniform per row (torch.multinomial costs ~1 ms a row over 49k tokens)
        cdf = logp.exp().cumsum(-1)
        u = torch.rand((len(sampling), 1), generator=self.generator) * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=logits.shape[-1] - 1)
        tokens = torch.where(greedy, logits.argmax(-1), drawn)
        token_lp = logp.gather(-1, tokens[:, None]).squeeze(-1)
        for (r, _), tok, lp in zip(sampling, tokens.tolist(), token_lp.tolist(), strict=True):
            r.tokens.append(tok)
            r.logprobs.append(lp)
            r.to_feed = [tok]
        self.stats.sampled_tokens += len(sampling)

    def _finished(self, r: Running) -> bool:
        last = r.tokens[-1]
        if last in self.stop_token_ids:
            finish = "stop"
        elif len(r.tokens) >= r.req.max_new_tokens or r.cache.length + 1 >= self.max_context:
            finish = "length"
        else:
            return False
        r.cache.busy = False  # resident: the episode's next turn extends it
        r.cache.last_used = time.monotonic()
        r.req.done(Generation(r.tokens, r.logprobs, finish, self.engine_id, r.version))
        return True


def _common(a: list[int], b: np.ndarray) -> int:
    m = min(len(a), len(b))
    same = np.asarray(a[:m]) == b[:m]
    return m if same.all() else int(same.argmin())
