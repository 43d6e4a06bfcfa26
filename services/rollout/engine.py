"""Generation engines: token ids in, sampled token ids and their behaviour logprobs out.

``Engine`` is the interface the rollout worker drives. ``QueuedEngine`` is the plumbing every engine
shares: requests and weight updates go into one queue that a single worker thread owns, and each
answer goes back to the asyncio loop that asked. Engines:

* ``ContinuousEngine`` (``services/rollout/continuous.py``, the default): continuous batching over a
  packed forward pass, a KV cache kept across the turns of an episode and shared by the episodes of a
  group, logprobs of the sampled tokens only;
* ``HFEngine`` (below): transformers' ``generate`` on batches of requests that arrive together; the
  simple reference the others are tested against;
* ``VLLMEngine`` (``services/rollout/vllm_engine.py``): vLLM, in its own venv.

The rule for weights, in every engine: an update lands *between* generations, so a turn is generated
entirely by one policy version, which its ``Generation`` records.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from services.rollout.adapters import AdapterSet, parse_adapter, version_hooks
from shared.lm import PackedLM, token_logprobs
from shared.model import load_model, load_weights_into


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (an end token was sampled) or "length"
    engine_id: str
    policy_version: int
    weights_digest: str = ""  # the announcement's digest of the weights held (the worker fills it in)


class Engine(Protocol):
    engine_id: str
    policy_version: int
    held_versions: tuple[int, ...]  # versions a request may name besides the current one

    async def generate(self, prompt: list[int], max_new_tokens: int, temperature: float,
                       version: int | None = None) -> Generation: ...

    async def update_weights(self, state: dict[str, torch.Tensor], version: int,
                             adapter: dict[str, torch.Tensor] | None = None) -> None: ...

    def close(self) -> None: ...


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    version: int | None = None  # a held policy version to play (``held_versions``); None: the current one

    def done(self, result: Any) -> None:
        self.loop.call_soon_threadsafe(_set_result, self.future, result)

    def fail(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(_set_exception, self.future, exc)


@dataclass
class WeightUpdate:
    state: dict[str, torch.Tensor]
    version: int
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    adapter: dict[str, torch.Tensor] | None = None  # the LoRA adapter merged into ``state``, for engines that hold versions

    def done(self, result: Any = None) -> None:
        # the engine has copied the weights (or skipped them): drop the tensors now. They are views of the
        # received buffer, which the worker refills with the next version only when no view is left, and
        # the engine thread keeps this update alive until its queue brings the next item
        self.state = {}
        self.adapter = None
        self.loop.call_soon_threadsafe(_set_result, self.future, result)

    def fail(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(_set_exception, self.future, exc)


STOP = None
"""Put on the queue by ``close``: the worker thread returns."""


class QueuedEngine:
    """One thread owns the model; ``generate`` and ``update_weights`` queue work for it. Subclasses
    implement ``_run``, which reads ``self._queue`` until it gets ``STOP``.

    By default the engine starts its own worker thread. A service can instead run the loop on the
    process's main thread (``own_thread=False``, then ``serve_here()`` there, with asyncio on another
    thread): replaying a bench workload in process, the same decode steps ran ~35 % faster on the main
    thread; why is not pinned down (docs/benchmarks.md, "SmolLM2 on 2 cores")."""

    engine_id: str
    policy_version: int
    held_versions: tuple[int, ...] = ()
    """Policy versions a request may name besides the current one (engines that hold LoRA adapters)."""

    def _start(self, engine_id: str, own_thread: bool = True) -> None:
        self.engine_id = engine_id
        self.policy_version = 0
        self._queue: queue.Queue[Request | WeightUpdate | None] = queue.Queue()
        self._serving = threading.Event()
        self._stopped = threading.Event()
        if own_thread:
            threading.Thread(target=self.serve_here, name=f"engine-{engine_id}", daemon=True).start()

    def serve_here(self) -> None:
        """Run the engine's loop on the calling thread until ``close``."""
        self._serving.set()
        try:
            self._run()
        finally:
            self._stopped.set()

    async def generate(self, prompt: list[int], max_new_tokens: int, temperature: float,
                       version: int | None = None) -> Generation:
        """One turn; ``version``: one of ``held_versions`` to play instead of the current one (a version the
        engine no longer holds when the request starts plays the current one: the ``Generation`` says which)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Generation] = loop.create_future()
        self._queue.put(Request(list(prompt), max_new_tokens, temperature, future, loop, version))
        return await future

    async def update_weights(self, state: dict[str, torch.Tensor], version: int,
                             adapter: dict[str, torch.Tensor] | None = None) -> None:
        """Load ``state`` as ``version``; ``adapter``: the LoRA pairs merged into it, which an engine that holds
        versions keeps (others ignore it)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put(WeightUpdate(state, version, future, loop, adapter))
        await future

    def close(self) -> None:
        self._queue.put(STOP)
        if self._serving.is_set():  # a loop that never started has nothing to finish
            self._stopped.wait(timeout=60)

    def _run(self) -> None:
        raise NotImplementedError


class HFEngine(QueuedEngine):
    """transformers ``generate`` with dynamic batching in one worker thread (the reference engine)."""

    def __init__(self, model_path: Any, engine_id: str, stop_token_ids: list[int], pad_token_id: int,
                 threads: int = 1, max_batch: int = 16, device: str = "cpu", own_thread: bool = True,
                 adapter_versions: int = 0, adapter_keep_every: int = 1) -> None:
        torch.set_num_threads(threads)
        self.threads = threads
        self.model = load_model(model_path, device=device).eval()
        self.stop_token_ids = stop_token_ids
        self.pad_token_id = pad_token_id
        self.max_batch = max_batch
        self.device = device
        # LoRA versions held beside the current (merged) one: a batch of another version runs with forward
        # hooks that add its low-rank difference (services/rollout/adapters.py); None: only the current one
        self.adapters = AdapterSet(PackedLM(self.model), adapter_versions, adapter_keep_every, concatenate=False) \
            if adapter_versions > 0 else None
        if self.adapters is not None:
            self.held_versions = self.adapters.versions
        self._start(engine_id, own_thread)

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # OpenMP's thread count is a setting of the thread that runs
        while True:
            item = self._queue.get()
            if item is STOP:
                return
            if isinstance(item, WeightUpdate):
                try:
                    adapter = None
                    if self.adapters is not None and item.adapter is not None:
                        adapter = parse_adapter(item.adapter, item.version)
                        adapter.pairs = {k: (a.to(self.device), b.to(self.device)) for k, (a, b) in adapter.pairs.items()}
                    load_weights_into(self.model, item.state)
                    if self.adapters is not None:
                        self.adapters.advance(item.version, adapter)
                        self.held_versions = self.adapters.versions
                    self.policy_version = item.version
                except Exception as exc:
                    item.fail(exc)
                else:
                    item.done()
                continue
            batch = [item]
            # Gather what else is waiting with the same sampling settings (stop at a weight update).
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if (isinstance(nxt, Request) and nxt.temperature == item.temperature
                        and nxt.max_new_tokens == item.max_new_tokens
                        and self._version_of(nxt) == self._version_of(item)):
                    batch.append(nxt)
                else:
                    self._queue.queue.appendleft(nxt)  # keep order: it runs right after this batch
                    break
            try:
                results = self._generate_batch(batch)
            except Exception as exc:  # fail the requests, keep the engine alive
                for req in batch:
                    req.fail(exc)
                continue
            for req, result in zip(batch, results, strict=True):
                req.done(result)

    def _version_of(self, req: Request) -> int:
        """The version a request plays: the one it names while it is held, else the current one."""
        if req.version is None or self.adapters is None or not self.adapters.holds(req.version):
            return self.policy_version
        return req.version

    def _generate_batch(self, batch: list[Request]) -> list[Generation]:
        version = self._version_of(batch[0])  # one version per batch (the gathering above sees to it)
        if version == self.policy_version or self.adapters is None:
            return self._generate_with(batch, version)
        hooks = version_hooks(self.adapters, self.model.get_decoder().layers, version)
        try:
            return self._generate_with(batch, version)
        finally:
            for hook in hooks:
                hook.remove()

    @torch.no_grad()
    def _generate_with(self, batch: list[Request], version: int) -> list[Generation]:
        temperature = batch[0].temperature
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every prompt ends at the same column
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
            dict(do_sample=False)
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            max_new_tokens=batch[0].max_new_tokens, eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id, return_dict_in_generate=True, output_logits=True, **sampling,
        )
        new_tokens = out.sequences[:, width:].cpu()
        # Behaviour logprobs: log-softmax of the raw logits at the sampling temperature (1 for greedy).
        logits = torch.stack(out.logits, dim=1).float().cpu()
        steps = new_tokens.shape[1]
        token_lp = token_logprobs(logits.reshape(-1, logits.shape[-1]), new_tokens.reshape(-1),
                                  temperature if temperature > 0 else 1.0).view(len(batch), steps)
        results = []
        for i in range(len(batch)):
            toks, lps = new_tokens[i].tolist(), token_lp[i].tolist()
            finish = "length"
            for j, tok in enumerate(toks):
                if tok in self.stop_token_ids:
                    toks, lps, finish = toks[: j + 1], lps[: j + 1], "stop"
                    break
            engine_id = self.engine_id if version == self.policy_version else f"{self.engine_id}@v{version}"
            results.append(Generation(toks, lps, finish, engine_id, version))
        return results


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
