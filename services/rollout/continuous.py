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
  system prompt of a task) attends to that prefix's keys/values by reference (a sealed ``Segment``,
  copied once out of the first sequence's tail) instead of recomputing them; a request that would
  share a prefix another request is encoding right now waits for it, then shares it.
* **One read per shared prefix.** A decode step scores a family's sealed segments (its *bank*) once for
  all the family's rows and every sequence's own tail (``TailPool``) in one batched matmul, under one
  softmax.
* **Sampled tokens only.** The LM head runs on the one row per sequence that samples.

Weights: an update stops admission, lets the running turns finish, swaps the weights and drops every
cache (its keys/values belong to the old policy), so each turn comes from one policy version.

Held versions (``adapter_versions`` > 0, LoRA broadcasts): the engine keeps the current adapter and up to
``adapter_versions - 1`` older ones beside the base weights (``services/rollout/adapters.py``), and a request
may name any of them or the base model (version 0); rows of other versions than the current one get
per-row low-rank corrections, batched by version. A sequence's keys/values are reused only by requests of
its own version, and an update keeps the caches of the versions still held.

Behaviour logprobs are ``log_softmax(logits / T)`` of the sampled token, the trainer's formula
(``shared.lm.token_logprobs``); greedy requests (T = 0) report T = 1.
"""

from __future__ import annotations

import functools
import mmap
import queue
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch

from services.rollout.adapters import AdapterSet, parse_adapter
from services.rollout.engine import STOP, Generation, QueuedEngine, Request, WeightUpdate
from shared.lm import PackedLM, cast_linear_weights, fuse_projections
from shared.model import load_model, load_weights_into

log = structlog.get_logger()

MATMUL_DTYPES: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}
"""``rollout.continuous.matmul_dtype``: fp32 throughout (exact against the fp32 trainer), or bf16 matmuls."""

MIN_SHARED_PREFIX = 16
"""Shorter common prefixes are recomputed rather than shared (not worth a cache lookup)."""


class Segment:
    """Sealed keys/values of a run of tokens, every layer. Never written again, so any number of sequences
    attend to it by reference: a group's opening is one segment that its episodes share."""

    __slots__ = ("kv", "tokens", "root")

    def __init__(self, kv: torch.Tensor, tokens: np.ndarray, root: Segment | None = None) -> None:
        self.kv = kv  # [layers, 2, kv_heads, length, head_dim]
        self.tokens = tokens
        self.root = root if root is not None else self  # views of one segment attend together

    @property
    def length(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> Segment:
        if n == self.length:
            return self
        return Segment(self.kv[:, :, :, :n], self.tokens[:n], self.root)


class TailPool:
    """The growing ends ("tails") of sequences, one slot each, all in one tensor: a decoding step attends to
    the tails of every running sequence in one batched matmul instead of one call per sequence.

    Slots only ever hold finite keys/values (zeros until written), so the masked-out positions of a batched
    attention contribute exactly 0. The pool is allocated at its full size once, as an anonymous mapping:
    the OS hands out zeroed pages on first touch, so it costs memory only where slots have been written, and
    transparent huge pages are declined for it, since a slot's tail touches a few KB per head and layer and
    a huge page would zero 2 MB around each. (Before: the pool started small and doubled by ``torch.zeros``
    + copy, which wrote gigabytes of zeros, ~24 % of a rollout bench run by py-spy; a calloc'd pool under
    huge pages moved that cost into the decode steps' first writes. AMD EPYC, 2 cores.)"""

    def __init__(self, lm: PackedLM, slot_tokens: int, max_slots: int) -> None:
        self.slot_tokens = slot_tokens
        self.max_slots = max_slots
        shape = (lm.num_layers, 2, max_slots, lm.num_kv_heads, slot_tokens, lm.head_dim)
        self._memory = mmap.mmap(-1, int(np.prod(shape)) * torch.empty((), dtype=lm.dtype).element_size())
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
            self._memory.madvise(mmap.MADV_NOHUGEPAGE)
        self.kv = torch.frombuffer(self._memory, dtype=lm.dtype).view(shape)
        self.free = list(range(max_slots))

    def take(self) -> int | None:
        if not self.free:
            return None
        self.free.sort(reverse=True)  # lowest slot first: a step's batched attention spans fewer slots
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def reset(self) -> None:
        self.free = list(range(self.max_slots))


class Sequence:
    """The keys/values of one token sequence, computed by one policy version: sealed segments (possibly
    shared with other sequences) followed by this sequence's own tail slot."""

    def __init__(self, slot: int, chain: list[Segment], tokens: np.ndarray, version: int) -> None:
        self.slot = slot
        self.chain = chain
        self.chain_length = sum(s.length for s in chain)
        self.tail_length = 0
        self.tokens = np.zeros(max(64, 2 * len(tokens)), dtype=np.int64)  # every token, for prefix matching
        self.tokens[: self.chain_length] = tokens[: self.chain_length]
        self.version = version
        self.busy = False  # owned by a running request (it may grow); others may still share its prefix
        self.last_used = time.monotonic()

    @property
    def length(self) -> int:
        return self.chain_length + self.tail_length

    def append_tokens(self, tokens: list[int]) -> None:
        end = self.length + len(tokens)
        if end > len(self.tokens):
            grown = np.zeros(2 * end, dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length: end] = tokens
        self.tail_length += len(tokens)

    def common_prefix(self, prompt: np.ndarray) -> int:
        m = min(self.length, len(prompt))
        if m == 0:
            return 0
        same = self.tokens[:m] == prompt[:m]
        return m if same.all() else int(same.argmin())

    def chain_prefix(self, n: int) -> list[Segment]:
        """The segments that hold this sequence's first ``n <= chain_length`` tokens (the last one a view)."""
        out, covered = [], 0
        for seg in self.chain:
            if covered >= n:
                break
            take = min(seg.length, n - covered)
            out.append(seg.prefix(take))
            covered += take
        return out


@dataclass
class Running:
    """A request being served: its sequence, the prompt tokens it has still to feed, what it sampled."""

    req: Request
    seq: Sequence
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
    shared_prefix_tokens: int = 0  # prompt tokens a request took by reference from another sequence's keys/values
    sealed_tokens: int = 0  # tokens whose keys/values were copied once into a shared segment
    waited_for_shared_prefix: int = 0
    fed_tokens: int = 0  # rows of every step (prompt chunks and decoded tokens): fed_tokens / steps = batch
    busy_s: float = 0.0  # time in forward passes and sampling


@dataclass
class Bank:
    """The sealed segments that a family of decoding rows attends to, concatenated once (every layer) so
    that one matmul scores every row of the family against all of them; a mask keeps each row to the
    segments (and prefixes of them) in its own chain."""

    roots: list[Segment]  # held, so that the ids in a cache key cannot be reused while it lives
    kv: torch.Tensor  # [layers, 2, kv_heads, bank tokens, head_dim]


@dataclass
class Family:
    """Decoding rows whose chains start with the same root segment (a task's opening): they share one bank."""

    rows: torch.Tensor | None  # local decoding rows of the family; None: every decoding row
    slots: torch.Tensor  # their tail slots, minus the plan's first slot
    bank: Bank | None  # None: no row of the family has a sealed segment (its tail holds everything)
    mask: torch.Tensor | None  # [1, rows * (heads per kv head), bank tokens]: 0 where a row sees, -inf elsewhere


@dataclass
class DecodePlan:
    """Index tensors of one step's decoding rows (one new token each), built once and used by every layer."""

    rows: torch.Tensor  # rows of the packed batch
    every_row: bool  # the decoding rows are the whole packed batch, in order (no prompt chunk this step)
    slots: torch.Tensor  # their tail slots
    positions: torch.Tensor  # where in its tail each row's key/value is written
    first_slot: int
    local_slots: torch.Tensor  # slots - first_slot
    tail_mask: torch.Tensor  # [slots in range, 1, 1, longest tail]: 0 where a slot's tail is, -inf after
    families: list[Family]


@dataclass
class PrefillFeed:
    """A sequence reading a chunk of its prompt this step: rows ``start:end`` of the packed batch."""

    seq: Sequence
    start: int
    end: int


class ContinuousEngine(QueuedEngine):
    def __init__(self, model_path: Any, engine_id: str, stop_token_ids: list[int], *, threads: int = 1,
                 max_batch: int = 64, prefill_chunk: int = 512, cache_tokens: int = 65536,
                 slot_tokens: int = 1024, max_context: int = 8192, seed: int = 0, device: str = "cpu",
                 own_thread: bool = True, matmul_dtype: str = "float32", adapter_versions: int = 0,
                 adapter_keep_every: int = 1) -> None:
        torch.set_num_threads(threads)
        self.threads = threads
        self.model = load_model(model_path, device=device).eval().requires_grad_(False)
        fuse_projections(self.model)
        if matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"matmul_dtype {matmul_dtype!r}: one of {', '.join(MATMUL_DTYPES)}")
        self.matmul_dtype = MATMUL_DTYPES[matmul_dtype]
        cast_linear_weights(self.model, self.matmul_dtype)
        self.lm = PackedLM(self.model)
        self.stop_token_ids = set(stop_token_ids)
        self.max_batch = max_batch
        self.prefill_chunk = min(prefill_chunk, slot_tokens)  # a chunk always fits in a tail slot
        self.cache_tokens = cache_tokens  # resident KV budget, in tokens (~46 KB each for SmolLM2 in fp32)
        self.max_context = max_context
        self.stats = EngineStats()
        self.generator = torch.Generator().manual_seed(zlib.crc32(f"{engine_id}/{seed}".encode()))
        # every running sequence holds a slot; idle ones (between turns) keep theirs until evicted
        self.pool = TailPool(self.lm, slot_tokens, max_slots=max(max_batch + 1, cache_tokens // slot_tokens))
        self.sequences: list[Sequence] = []
        self._banks: dict[tuple[int, ...], Bank] = {}  # the last step's banks, by their roots' ids
        # LoRA versions held beside the current one (cross-policy sampling in one engine); None: only the current
        self.adapters = AdapterSet(self.lm, adapter_versions, adapter_keep_every) if adapter_versions > 0 else None
        if self.adapters is not None:
            self.held_versions = self.adapters.versions
        self._start(engine_id, own_thread)

    # ------------------------------------------------------------------ the engine's thread
    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # OpenMP's thread count is a setting of the thread that runs
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
                        self._drop(r.seq)
                        r.req.fail(exc)
                    running.clear()

    def _apply_weights(self, update: WeightUpdate) -> None:
        try:
            adapter = None
            if self.adapters is not None and update.adapter is not None:
                adapter = parse_adapter(update.adapter, update.version)  # checked before the weights change
            load_weights_into(self.model, update.state)
            cast_linear_weights(self.model, self.matmul_dtype)  # the low-precision copies follow the new weights
            if self.adapters is not None:
                self.adapters.advance(update.version, adapter)
                self.held_versions = self.adapters.versions
        except Exception as exc:
            update.fail(exc)
            return
        self.policy_version = update.version
        self._banks.clear()
        if self.adapters is None:
            self.sequences.clear()  # their keys/values were computed by the old weights
            self.pool.reset()
        else:  # keep the keys/values of versions still held (the new version has none yet)
            held = set(self.held_versions) - {update.version}
            for seq in [s for s in self.sequences if s.version not in held]:
                self._drop(seq)
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
            version = self._version_of(req)
            best, shared = self._best_sequence(prompt, version)
            # Another request is encoding a longer common prefix right now: share it when it is done.
            if any(r.reading_prompt and r.version == version and _common(r.req.prompt, prompt) >= shared + MIN_SHARED_PREFIX
                   for r in running):
                self.stats.waited_for_shared_prefix += 1
                still.append(req)
                continue
            started = self._start_request(req, prompt, best, shared, version)
            if started is None:  # every slot is held by a running sequence: wait for one to finish
                still.append(req)
                continue
            running.append(started)
        return still

    def _version_of(self, req: Request) -> int:
        """The version a request plays: the one it names while it is held, else the current one."""
        if req.version is None or self.adapters is None or not self.adapters.holds(req.version):
            return self.policy_version
        return req.version

    def _best_sequence(self, prompt: np.ndarray, version: int) -> tuple[Sequence | None, int]:
        best, shared = None, 0
        for seq in self.sequences:
            if seq.version != version:  # keys/values of another policy version: not this request's
                continue
            n = seq.common_prefix(prompt)
            # prefer a sequence this request can take over (idle, wholly a prefix of the prompt): no new slot
            if n > shared or (n == shared and best is not None and n == seq.length and not seq.busy):
                best, shared = seq, n
        return best, shared

    def _start_request(self, req: Request, prompt: np.ndarray, best: Sequence | None,
                       shared: int, version: int) -> Running | None:
        shared = min(shared, len(prompt) - 1)  # the last prompt token is always fed: it yields the first logits
        if best is not None and not best.busy and shared >= best.length - 1 and shared >= MIN_SHARED_PREFIX:
            seq = best  # the episode's previous turn: extend it in place
            self._truncate(seq, shared)
        else:
            chain: list[Segment] = []
            if best is not None and shared >= MIN_SHARED_PREFIX:
                chain = self._share(best, shared)
                self.stats.shared_prefix_tokens += shared
            else:
                shared = 0
            slot = self._take_slot()
            if slot is None:
                return None
            seq = Sequence(slot, chain, prompt, version)
            self.sequences.append(seq)
        seq.busy = True
        seq.last_used = time.monotonic()
        self.stats.prompt_tokens += len(prompt)
        self._evict()
        return Running(req, seq, prompt[shared:].tolist(), version)

    def _share(self, source: Sequence, n: int) -> list[Segment]:
        """Segments holding ``source``'s first ``n`` tokens, for another sequence to attend to by reference.
        Tokens still in ``source``'s tail are sealed into a segment first (copied once; ``source`` then
        attends to that segment too, and its tail keeps only what follows)."""
        if n > source.chain_length:
            self._seal(source, n - source.chain_length)
        return source.chain_prefix(n)

    def _seal(self, seq: Sequence, n: int) -> None:
        """Move the first ``n`` tokens of ``seq``'s tail into a new sealed segment at the end of its chain."""
        kv = self.pool.kv[:, :, seq.slot, :, :n].clone()
        start = seq.chain_length
        seq.chain.append(Segment(kv, seq.tokens[start: start + n].copy()))
        rest = seq.tail_length - n
        if rest:
            self.pool.kv[:, :, seq.slot, :, :rest] = self.pool.kv[:, :, seq.slot, :, n: n + rest].clone()
        seq.chain_length += n
        seq.tail_length = rest
        self.stats.sealed_tokens += n

    @staticmethod
    def _truncate(seq: Sequence, n: int) -> None:
        if n >= seq.chain_length:
            seq.tail_length = n - seq.chain_length
        else:  # the new prompt leaves this sequence inside its sealed segments
            seq.chain = seq.chain_prefix(n)
            seq.chain_length, seq.tail_length = n, 0

    def _take_slot(self) -> int | None:
        slot = self.pool.take()
        if slot is None:  # the pool is at its size: evict the least recently used idle sequence
            idle = sorted((s for s in self.sequences if not s.busy), key=lambda s: s.last_used)
            if not idle:
                return None
            self._drop(idle[0])
            slot = self.pool.take()
        return slot

    def _drop(self, seq: Sequence) -> None:
        if seq in self.sequences:
            self.sequences.remove(seq)
            self.pool.give(seq.slot)

    def _evict(self) -> None:
        """Drop least recently used idle sequences beyond the resident budget (tail slots + sealed segments)."""
        def resident() -> int:
            roots = {id(seg.root): seg.root.length for seq in self.sequences for seg in seq.chain}
            return len(self.sequences) * self.pool.slot_tokens + sum(roots.values())

        if resident() <= self.cache_tokens:
            return
        for seq in sorted((s for s in self.sequences if not s.busy), key=lambda s: s.last_used):
            self._drop(seq)
            if resident() <= self.cache_tokens:
                break

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def _step(self, running: list[Running]) -> None:
        started = time.perf_counter()
        budget = self.prefill_chunk
        feeds: list[tuple[Running, list[int]]] = []
        for r in running:
            if len(r.to_feed) == 1:
                chunk = r.to_feed
            elif budget > 0:  # prompt chunks share the budget; decoding sequences always advance
                chunk = r.to_feed[:budget]
                budget -= len(chunk)
            else:
                continue
            if r.seq.tail_length + len(chunk) > self.pool.slot_tokens:  # a full tail becomes a segment
                self._seal(r.seq, r.seq.tail_length)
            feeds.append((r, chunk))
        ids = torch.tensor([t for _, chunk in feeds for t in chunk])
        positions = torch.cat([torch.arange(r.seq.length, r.seq.length + len(chunk)) for r, chunk in feeds])
        rows = np.cumsum([0] + [len(chunk) for _, chunk in feeds])
        total = int(rows[-1])
        decode = self._decode_plan([(r.seq, int(a)) for (r, chunk), a in zip(feeds, rows[:-1], strict=True)
                                    if len(chunk) == 1], total)
        prefill = [PrefillFeed(r.seq, int(a), int(b)) for (r, chunk), a, b in zip(feeds, rows[:-1], rows[1:],
                                                                                 strict=True) if len(chunk) > 1]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if decode is not None and decode.every_row:
                return self._decode_attention(layer, decode, q, k, v)
            out = q.new_empty((total, self.lm.num_heads * self.lm.head_dim))
            if decode is not None:
                out[decode.rows] = self._decode_attention(layer, decode, q, k, v)
            for feed in prefill:
                out[feed.start: feed.end] = self._prefill_attention(layer, feed, q, k, v)
            return out

        correct = None
        if self.adapters is not None:  # rows of other held versions than the current one: their corrections
            row_versions = np.repeat([r.version for r, _ in feeds], [len(chunk) for _, chunk in feeds])
            step = self.adapters.corrections(row_versions)
            if step is not None:
                correct = functools.partial(self.adapters.correct, step)
        hidden = self.lm.hidden(ids, positions, attend, correct)
        sampling: list[tuple[Running, int]] = []
        for (r, chunk), b in zip(feeds, rows[1:], strict=True):
            r.seq.append_tokens(chunk)
            r.to_feed = r.to_feed[len(chunk):]
            if r.reading_prompt:
                self.stats.prefilled_tokens += len(chunk)
            if not r.to_feed:  # the whole prompt (or the last sampled token) is in: sample the next token
                sampling.append((r, int(b) - 1))
        self.stats.steps += 1
        self.stats.fed_tokens += total
        if sampling:
            self._sample(sampling, hidden)
        self.stats.busy_s += time.perf_counter() - started
        for r in [r for r, _ in sampling]:
            if self._finished(r):
                running.remove(r)

    def _decode_plan(self, decoding: list[tuple[Sequence, int]], total: int) -> DecodePlan | None:
        if not decoding:
            return None
        slots = [seq.slot for seq, _ in decoding]
        first, last = min(slots), max(slots)
        lengths = torch.ones(last - first + 1, dtype=torch.long)  # slots in range that do not decode: see 1
        for seq, _ in decoding:
            lengths[seq.slot - first] = seq.tail_length + 1
        longest = int(lengths.max())
        mask = torch.zeros((len(lengths), longest), dtype=self.lm.dtype)
        mask.masked_fill_(torch.arange(longest)[None, :] >= lengths[:, None], float("-inf"))
        slot_index = torch.tensor(slots)
        local_slots = slot_index - first
        by_root: dict[int, list[int]] = {}
        for i, (seq, _) in enumerate(decoding):
            by_root.setdefault(id(seq.chain[0].root) if seq.chain else 0, []).append(i)
        banks: dict[tuple[int, ...], Bank] = {}
        families = []
        for idx in by_root.values():
            family_rows = None if len(idx) == len(decoding) else torch.tensor(idx)
            family_slots = local_slots if family_rows is None else local_slots[family_rows]
            bank, bank_mask = self._bank([decoding[i][0] for i in idx], banks)
            families.append(Family(family_rows, family_slots, bank, bank_mask))
        self._banks = banks  # banks no family uses this step are freed
        every_row = len(decoding) == total
        return DecodePlan(rows=torch.tensor([row for _, row in decoding]), every_row=every_row, slots=slot_index,
                          positions=torch.tensor([seq.tail_length for seq, _ in decoding]), first_slot=first,
                          local_slots=local_slots, tail_mask=mask.view(len(lengths), 1, 1, longest),
                          families=families)

    def _bank(self, seqs: list[Sequence], banks: dict[tuple[int, ...], Bank]) -> tuple[Bank | None, torch.Tensor | None]:
        """The bank of these sequences' sealed segments (reused from the last step when they are the same
        roots: a bank changes only when a family gains or loses a segment) and each row's mask over it."""
        roots: dict[int, Segment] = {}
        for seq in seqs:
            for seg in seq.chain:
                roots.setdefault(id(seg.root), seg.root)
        if not roots:
            return None, None
        key = tuple(roots)
        bank = banks.get(key) or self._banks.get(key)
        if bank is None:
            members = list(roots.values())
            bank = Bank(members, torch.cat([r.kv for r in members], dim=3) if len(members) > 1 else members[0].kv)
        banks[key] = bank
        offsets, at = {}, 0
        for root_id, root in roots.items():
            offsets[root_id] = at
            at += root.length
        visible = np.zeros((len(seqs), at), dtype=bool)
        for i, seq in enumerate(seqs):
            for seg in seq.chain:
                start = offsets[id(seg.root)]
                visible[i, start: start + seg.length] = True
        rep = self.lm.num_heads // self.lm.num_kv_heads
        bias = np.where(visible, np.float32(0), np.float32(-np.inf)).repeat(rep, axis=0)
        return bank, torch.from_numpy(bias).to(self.lm.dtype)[None]

    def _decode_attention(self, layer: int, plan: DecodePlan, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor) -> torch.Tensor:
        """One new token per sequence attends to its sealed segments (a family's bank, scored for every row
        of the family in one matmul: a group's opening is read once per step, not once per episode) and to
        its own tail (every tail in one batched matmul over the slot range), under one softmax.

        About twenty tensor ops a layer whatever the number of groups: on a CPU each op costs ~10-50 us
        of dispatch and threading at these sizes, more than its arithmetic."""
        lm = self.lm
        kv_heads, rep, d = lm.num_kv_heads, lm.num_heads // lm.num_kv_heads, lm.head_dim
        pool = self.pool.kv[layer]  # [2, slots, kv_heads, slot_tokens, d]
        k_rows, v_rows, q_rows = (k, v, q) if plan.every_row else (k[plan.rows], v[plan.rows], q[plan.rows])
        pool[0, plan.slots, :, plan.positions] = k_rows
        pool[1, plan.slots, :, plan.positions] = v_rows
        rows = len(plan.rows)
        qd = (q_rows * lm.scale).view(rows, kv_heads, rep, d)
        span, longest = plan.tail_mask.shape[0], plan.tail_mask.shape[-1]
        keys = pool[0, plan.first_slot: plan.first_slot + span, :, :longest]
        values = pool[1, plan.first_slot: plan.first_slot + span, :, :longest]
        qs = q.new_zeros((span, kv_heads, rep, d))
        qs[plan.local_slots] = qd
        tail_scores = torch.matmul(qs, keys.transpose(-1, -2)).add_(plan.tail_mask)  # [span, kv, rep, longest]
        tail_probs = torch.zeros_like(tail_scores)
        out = None
        for fam in plan.families:
            scores = tail_scores[fam.slots]  # [family rows, kv, rep, longest]
            if fam.bank is None:
                tail_probs[fam.slots] = torch.softmax(scores, dim=-1)
                continue
            n = scores.shape[0]
            bank_kv = fam.bank.kv[layer]  # [2, kv, bank tokens, d]
            width = bank_kv.shape[2]
            qf = qd if fam.rows is None else qd[fam.rows]
            qb = qf.permute(1, 0, 2, 3).reshape(kv_heads, n * rep, d)
            bank_scores = torch.baddbmm(fam.mask, qb, bank_kv[0].transpose(1, 2))  # [kv, n * rep, bank]
            joint = torch.cat([bank_scores.view(kv_heads, n, rep, width).permute(1, 0, 2, 3), scores], dim=-1)
            probs = torch.softmax(joint, dim=-1)
            tail_probs[fam.slots] = probs[..., width:]
            bank_probs = probs[..., :width].permute(1, 0, 2, 3).reshape(kv_heads, n * rep, width)
            bank_out = torch.bmm(bank_probs, bank_kv[1]).view(kv_heads, n, rep, d).permute(1, 0, 2, 3)
            if fam.rows is None:
                out = bank_out
            else:
                if out is None:
                    out = q.new_zeros((rows, kv_heads, rep, d))
                out[fam.rows] = bank_out
        tail_out = torch.matmul(tail_probs, values)[plan.local_slots]  # [rows, kv, rep, d]
        if out is not None:
            tail_out = tail_out + out
        return tail_out.reshape(rows, lm.num_heads * d)

    def _prefill_attention(self, layer: int, feed: PrefillFeed, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor) -> torch.Tensor:
        """A prompt chunk attends causally to everything before it: its segments and its tail (rarer than
        decoding, so the keys/values are simply concatenated)."""
        seq, n = feed.seq, feed.end - feed.start
        pool = self.pool.kv[layer]
        t0 = seq.tail_length
        pool[0, seq.slot, :, t0: t0 + n] = k[feed.start: feed.end].transpose(0, 1)
        pool[1, seq.slot, :, t0: t0 + n] = v[feed.start: feed.end].transpose(0, 1)
        keys = torch.cat([seg.kv[layer, 0] for seg in seq.chain] + [pool[0, seq.slot, :, : t0 + n]], dim=1)
        values = torch.cat([seg.kv[layer, 1] for seg in seq.chain] + [pool[1, seq.slot, :, : t0 + n]], dim=1)
        return self.lm.attention(q[feed.start: feed.end], keys.transpose(0, 1), values.transpose(0, 1),
                                 seq.length)

    def _sample(self, sampling: list[tuple[Running, int]], hidden: torch.Tensor) -> None:
        """Draw each row's next token from ``softmax(logits / T)`` and keep its logprob, the trainer's
        ``log_softmax(logits / T)`` at that token.

        Over [rows, 49k] every full-vocabulary pass costs ~1-4 ms on 2 cores (torch profile), so this makes
        few: the logits are scaled in place (not at all when every T is 1), the CDF is exponentiated and
        summed in one buffer, and ``argmax`` runs only when a row is greedy."""
        logits = self.lm.logits(hidden[[row for _, row in sampling]])
        temps = [r.req.temperature if r.req.temperature > 0 else 1.0 for r, _ in sampling]
        if any(t != 1.0 for t in temps):
            logits.div_(torch.tensor(temps)[:, None])
        logp = torch.log_softmax(logits, dim=-1)
        # inverse-CDF sampling: one uniform per row (torch.multinomial costs ~1 ms a row over 49k tokens)
        cdf = logp.exp().cumsum_(-1)
        u = torch.rand((len(sampling), 1), generator=self.generator) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
        greedy = [r.req.temperature <= 0 for r, _ in sampling]
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy), logits.argmax(-1), tokens)
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
        elif len(r.tokens) >= r.req.max_new_tokens or r.seq.length + 1 >= self.max_context:
            finish = "length"
        else:
            return False
        r.seq.busy = False  # resident: the episode's next turn extends it
        r.seq.last_used = time.monotonic()
        # a turn of another version than the current one names it: an engine of its own in the trajectory
        engine_id = self.engine_id if r.version == self.policy_version else f"{self.engine_id}@v{r.version}"
        r.req.done(Generation(r.tokens, r.logprobs, finish, engine_id, r.version))
        return True


def _common(a: list[int], b: np.ndarray) -> int:
    m = min(len(a), len(b))
    same = np.asarray(a[:m]) == b[:m]
    return m if same.all() else int(same.argmin())
