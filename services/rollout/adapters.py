"""Several LoRA policy versions in one engine (cross-policy sampling without a second model).

With LoRA the trainer broadcasts only the adapter, as ``(A, scaled B)`` pairs (``shared.model.lora_delta``),
so an older policy is the same base weights with an older adapter. An engine that holds a few adapters can
play any of those versions, or the base model itself (version 0, no adapter), row by row in one batch:

* the model's weights are the **current** version, merged (``W0 + B_c A_c``), so a step whose rows all play
  the current version costs exactly what it costs without adapters;
* a row of another version ``v`` adds its low-rank difference to each projection's output:
  ``x A_v^T B_v^T - x A_c^T B_c^T`` (the first term is absent for the base model, version 0).

Every held adapter's pairs are concatenated once per layer and projection (the engine's fused layout:
q/k/v as one, gate/up as one), so a step's corrections are two matmuls per projection whatever the mix of
versions: ``((x @ A_cat^T) * mask) @ B_cat^T``, where a row's ``mask`` is +1 on its version's columns, -1
on the current version's and 0 elsewhere. Rows of the current version take no part (they are left out
of the matmuls when the step has any).

Which older versions are held: the version that stops being current is kept when no older one is, or when
it is at least ``keep_every`` versions newer than the newest kept one (``rollout.stale_every``, as a stale
engine follows weights), up to ``capacity - 1`` older ones, the oldest dropped first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from shared.lm import PackedLM

LORA_A, LORA_B = ".lora_A", ".lora_B"
BASE_VERSION = 0
"""The base weights, no adapter: what the trainer's version 0 is with LoRA (B = 0 at the start)."""

_MODULE = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")

PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""The packed forward's projections (``shared.lm.PackedLM.hidden``) and the modules each one fuses, in order."""


@dataclass
class HeldAdapter:
    """One version's adapter: per layer and module name, ``A [rank, in]`` and ``B [out, rank]`` (scaled)."""

    version: int
    rank: int
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ProjectionPairs:
    """Every held adapter of one layer's projection, concatenated: ``a_t [in, columns]``, ``b_t [columns, out]``."""

    a_t: torch.Tensor
    b_t: torch.Tensor


@dataclass
class StepCorrections:
    """One step's per-row corrections: the packed rows that play another version than the current one, and
    per projection the mask over the concatenated adapter columns (``[rows, columns]``)."""

    rows: torch.Tensor | None  # None: every row of the step
    masks: dict[str, torch.Tensor]


def parse_adapter(delta: dict[str, torch.Tensor], version: int) -> HeldAdapter:
    """A broadcast adapter (``{module}.lora_A`` / ``{module}.lora_B``) as an owned fp32 copy, by layer and
    module; refused when it adapts a module the per-row corrections cannot reach."""
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    known = {m for modules in PROJECTIONS.values() for m in modules}
    ranks = set()
    for key, a in delta.items():
        if key.endswith(LORA_B):
            continue
        if not key.endswith(LORA_A):
            raise ValueError(f"adapter v{version}: {key!r} is not a LoRA pair tensor")
        module = key[: -len(LORA_A)]
        b = delta.get(module + LORA_B)
        found = _MODULE.match(module)
        if b is None or found is None or found.group(2) not in known:
            raise ValueError(f"adapter v{version}: {module!r} is not a decoder projection an engine can hold "
                             f"as an adapter ({', '.join(sorted(known))})")
        if b.shape[1] != a.shape[0]:
            raise ValueError(f"adapter v{version}: {module!r} A {tuple(a.shape)} and B {tuple(b.shape)} disagree")
        # copies: the broadcast tensors are views of the worker's receive buffer, which is reused
        pairs[(int(found.group(1)), found.group(2))] = (a.detach().to(torch.float32).clone(),
                                                        b.detach().to(torch.float32).clone())
        ranks.add(a.shape[0])
    stray = [k for k in delta if k.endswith(LORA_B) and k[: -len(LORA_B)] + LORA_A not in delta]
    if stray:
        raise ValueError(f"adapter v{version}: B without A for {stray[:3]}")
    if len(ranks) > 1:
        raise ValueError(f"adapter v{version}: modules of different ranks {sorted(ranks)}")
    return HeldAdapter(version, ranks.pop() if ranks else 0, pairs)


class AdapterSet:
    """The adapters one engine holds (the current version's and up to ``capacity - 1`` older ones) and the
    per-row corrections a step needs. Lives on the engine's thread; ``versions`` may be read anywhere."""

    def __init__(self, lm: PackedLM, capacity: int, keep_every: int, concatenate: bool = True) -> None:
        if capacity < 1:
            raise ValueError(f"adapter capacity {capacity}: at least 1 (the current version)")
        self.lm = lm
        self.capacity = capacity
        self.keep_every = max(1, keep_every)
        self.concatenate = concatenate  # False: the pairs are applied module by module (``version_hooks``)
        self.device = next(lm.decoder.parameters()).device  # the concatenated pairs live beside the weights
        self.held: list[HeldAdapter] = []  # oldest first; the current version's last (when it has one)
        self.current = BASE_VERSION
        self.versions: tuple[int, ...] = (BASE_VERSION,)  # every version a request may name, current last
        self._projections: list[dict[str, ProjectionPairs]] = []
        self._column_versions: dict[str, torch.Tensor] = {}  # per projection: index into held, per column
        self._sizes = self._projection_sizes()

    def _projection_sizes(self) -> dict[str, tuple[int, int]]:
        """Per module: (in, out) features, read from the model's layer 0."""
        layer = self.lm.decoder.layers[0]
        sizes = {}
        for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weight = getattr(layer.self_attn, module).weight
            sizes[module] = (weight.shape[1], weight.shape[0])
        for module in ("gate_proj", "up_proj", "down_proj"):
            weight = getattr(layer.mlp, module).weight
            sizes[module] = (weight.shape[1], weight.shape[0])
        return sizes

    def holds(self, version: int) -> bool:
        return version in self.versions

    def advance(self, version: int, adapter: HeldAdapter | None) -> None:
        """``version`` is now current, with ``adapter`` merged into the model's weights. ``adapter`` None (a
        broadcast of full weights): nothing older can be played from these weights any more, not even the base."""
        if adapter is None:
            self.held.clear()
            self.current = version
            self.versions = (version,)
            self._rebuild()
            return
        for pair_key, (a, b) in adapter.pairs.items():
            size = self._sizes[pair_key[1]]
            if (a.shape[1], b.shape[0]) != size:
                raise ValueError(f"adapter v{version}: layer {pair_key[0]} {pair_key[1]} is {a.shape[1]} -> "
                                 f"{b.shape[0]}, the model's is {size[0]} -> {size[1]}")
            if pair_key[0] >= self.lm.num_layers:
                raise ValueError(f"adapter v{version}: layer {pair_key[0]} of a {self.lm.num_layers}-layer model")
        older = [h for h in self.held if h.version != self.current]
        previous = next((h for h in self.held if h.version == self.current), None)
        if previous is not None and (not older or previous.version - older[-1].version >= self.keep_every):
            older.append(previous)
        older = older[max(0, len(older) - (self.capacity - 1)):] if self.capacity > 1 else []
        self.held = [*older, adapter]
        self.current = version
        self.versions = (BASE_VERSION, *(h.version for h in older), version)
        self._rebuild()

    def _rebuild(self) -> None:
        """Concatenate every held adapter per layer and projection (zeros where one lacks a module)."""
        self._projections = []
        self._column_versions = {}
        if not self.held or not self.concatenate:
            return
        for kind, modules in PROJECTIONS.items():
            columns = []
            for index, held in enumerate(self.held):
                columns += [index] * (held.rank * len(modules))
            self._column_versions[kind] = torch.tensor(columns, dtype=torch.long, device=self.device)
        for layer in range(self.lm.num_layers):
            per_kind = {}
            for kind, modules in PROJECTIONS.items():
                in_features = self._sizes[modules[0]][0]
                outs = [self._sizes[m][1] for m in modules]
                width = sum(h.rank for h in self.held) * len(modules)
                a_t = torch.zeros((in_features, width), device=self.device)
                b_t = torch.zeros((width, sum(outs)), device=self.device)
                col = 0
                for held in self.held:
                    row = 0
                    for module, out in zip(modules, outs, strict=True):
                        pair = held.pairs.get((layer, module))
                        if pair is not None:
                            a, b = pair
                            a_t[:, col: col + held.rank] = a.T
                            b_t[col: col + held.rank, row: row + out] = b.T
                        col += held.rank
                        row += out
                per_kind[kind] = ProjectionPairs(a_t, b_t)
            self._projections.append(per_kind)

    def corrections(self, row_versions: np.ndarray) -> StepCorrections | None:
        """The corrections for a step whose packed rows play ``row_versions`` (each one of ``versions``);
        None when every row plays the current version."""
        other = row_versions != self.current
        if not other.any():
            return None
        index = {h.version: i for i, h in enumerate(self.held)}
        rows = np.flatnonzero(other)
        versions = row_versions[rows]
        coefficients = np.zeros((len(rows), len(self.held)), dtype=np.float32)
        if self.current in index:  # every such row leaves the current version's adapter
            coefficients[:, index[self.current]] = -1.0
        adapted = np.flatnonzero(versions != BASE_VERSION)  # and takes its own (the base model has none)
        if len(adapted):
            unique, which = np.unique(versions[adapted], return_inverse=True)
            columns = np.array([index[int(v)] for v in unique])
            coefficients[adapted, columns[which]] = 1.0
        c = torch.from_numpy(coefficients).to(self.device)
        masks = {kind: c[:, columns] for kind, columns in self._column_versions.items()}
        every_row = len(rows) == len(row_versions)
        return StepCorrections(None if every_row else torch.from_numpy(rows).to(self.device), masks)

    def correct(self, step: StepCorrections, layer: int, kind: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the projection of ``x``, every packed row) with the step's rows moved to their versions."""
        pairs = self._projections[layer][kind]
        mask = step.masks[kind]
        if step.rows is None:
            return out.addmm_(torch.mm(x, pairs.a_t).mul_(mask), pairs.b_t)
        delta = torch.mm(torch.mm(x.index_select(0, step.rows), pairs.a_t).mul_(mask), pairs.b_t)
        return out.index_add_(0, step.rows, delta)


def module_of(layers: torch.nn.ModuleList, layer: int, module: str) -> torch.nn.Module:
    """The HF decoder layer's projection module of that name."""
    block = layers[layer]
    return getattr(block.self_attn if hasattr(block.self_attn, module) else block.mlp, module)


def version_hooks(adapters: AdapterSet, layers: torch.nn.ModuleList, version: int) -> list[torch.utils.hooks.RemovableHandle]:
    """Forward hooks that make a model holding the current version merged play ``version`` instead (one of
    ``adapters.versions``): each adapted projection adds ``x A_v^T B_v^T - x A_c^T B_c^T`` to its output. For
    engines that run the model's own forward (``HFEngine``), one version per batch; remove them after."""
    by_version = {h.version: h for h in adapters.held}
    play, current = by_version.get(version), by_version.get(adapters.current)
    modules = set(play.pairs if play is not None else ()) | set(current.pairs if current is not None else ())
    handles = []
    for key in sorted(modules):
        add = play.pairs.get(key) if play is not None else None
        subtract = current.pairs.get(key) if current is not None else None

        def hook(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor,
                 add: tuple[torch.Tensor, torch.Tensor] | None = add,
                 subtract: tuple[torch.Tensor, torch.Tensor] | None = subtract) -> torch.Tensor:
            x = inputs[0].to(torch.float32)
            delta = torch.zeros_like(output, dtype=torch.float32)
            if add is not None:
                delta += (x @ add[0].T) @ add[1].T
            if subtract is not None:
                delta -= (x @ subtract[0].T) @ subtract[1].T
            return output + delta.to(output.dtype)

        handles.append(module_of(layers, *key).register_forward_hook(hook))
    return handles
