"""A packed, segment-wise forward pass of a Llama-family causal LM, shared by the rollout engine and
the trainer so that both compute the very same numbers.

Tokens of many sequences go through the linear layers as one ``[N, hidden]`` matrix, with no padding;
only attention and rotary positions look at sequence boundaries. The caller says how attention works
through one function, ``attend(layer, q, k, v) -> out``:

* the rollout engine attends each sequence's new tokens to its own KV cache (continuous batching,
  KV reuse across turns and across the episodes of a group that share an opening);
* the trainer attends the tokens of a segment to the keys/values of its ancestor segments computed in
  the same pass (shared-prefix training: a group's opening runs once, with gradient, for all episodes).

Supported: the HF ``LlamaForCausalLM`` family layout (Llama, SmolLM2, Qwen2, Mistral without sliding
windows): RMSNorm, rotary positions from the model's own rotary module, grouped-query attention, gated
MLP. Layers are called module by module, so PEFT's LoRA wrappers on the projections apply as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer_index, q [N, heads, d], k [N, kv_heads, d], v [N, kv_heads, d]) -> [N, heads * d]``"""

Correct = Callable[[int, str, torch.Tensor, torch.Tensor], torch.Tensor]
"""``correct(layer_index, projection, x, out) -> out``: the fused projections' outputs (``qkv``, ``o``,
``gate_up``, ``down``) adjusted row by row, e.g. per-row LoRA versions (services/rollout/adapters.py)."""


class PackedLM:
    """A view of an HF causal LM (or a PEFT model around one) that runs packed token batches."""

    def __init__(self, model: Any) -> None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: LoRA layers inside
        config = base.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {config.model_type!r} is not supported by the packed forward "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
            raise ValueError("sliding-window attention is not supported by the packed forward")
        self.model = model
        self.decoder = base.model
        self.head = base.get_output_embeddings()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.scale = self.head_dim ** -0.5
        self.dtype = next(base.parameters()).dtype

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
               correct: Correct | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[N, hidden]`` of packed tokens ``ids [N]`` at ``positions [N]``.
        ``correct`` (fused projections only: ``fuse_projections``) adjusts each projection's output."""
        n = ids.shape[0]
        x = self.decoder.embed_tokens(ids)
        cos, sin = self.decoder.rotary_emb(x[None], positions[None])  # the model's own rotary variant
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [N, 1, d]: broadcast over heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for i, layer in enumerate(self.decoder.layers):
            h = _rms_norm(layer.input_layernorm, x)
            attn = layer.self_attn
            fused = getattr(layer, FUSED, None)
            low = fused.low if fused is not None else None
            if low is not None:  # bf16 matrix units (cast_linear_weights): same layout, low-precision matmuls
                qkv = _low_linear(h, low.qkv, fused.qkv_bias)
            elif fused is not None:  # one matmul for q, k, v and one for gate, up (fuse_projections)
                qkv = F.linear(h, fused.qkv_weight, fused.qkv_bias)
            else:
                if correct is not None:
                    raise ValueError("per-row projection corrections need fused projections (fuse_projections)")
                qkv = None
            if qkv is not None:
                if correct is not None:
                    qkv = correct(i, "qkv", h, qkv)
                q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            else:
                q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            q = q.reshape(n, self.num_heads, self.head_dim)
            k = k.reshape(n, self.num_kv_heads, self.head_dim)
            v = v.reshape(n, self.num_kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            attended = attend(i, q, k, v)
            if low is not None:
                o = _low_linear(attended, low.o, attn.o_proj.bias)
            else:
                o = attn.o_proj(attended)
            if correct is not None:
                o = correct(i, "o", attended, o)
            x = x + o
            h = _rms_norm(layer.post_attention_layernorm, x)
            if fused is None:
                x = x + layer.mlp(h)
                continue
            gate_up = _low_linear(h, low.gate_up) if low is not None else F.linear(h, fused.gate_up_weight)
            if correct is not None:
                gate_up = correct(i, "gate_up", h, gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            inner = layer.mlp.act_fn(gate) * up
            down = _low_linear(inner, low.down, layer.mlp.down_proj.bias) if low is not None else \
                layer.mlp.down_proj(inner)
            if correct is not None:
                down = correct(i, "down", inner, down)
            x = x + down
        return _rms_norm(self.decoder.norm, x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        low_head = getattr(self.model, LOW_HEAD, None)
        if low_head is not None:
            return _low_linear(hidden, low_head, self.head.bias)
        return self.head(hidden).float()

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int) -> torch.Tensor:
        """One segment: ``q [T, heads, d]`` attends causally to ``k, v [context + T, kv_heads, d]``, whose
        first ``context`` rows come before the segment. Returns ``[T, heads * d]``."""
        t = q.shape[0]
        if t == 1:  # one new token sees everything: no mask
            mask, causal = None, False
        elif context == 0:
            mask, causal = None, True
        else:
            total = k.shape[0]
            mask = torch.arange(total)[None, :] <= (context + torch.arange(t))[:, None]
            causal = False
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=mask, is_causal=causal,
                                             scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)
        return out[0].transpose(0, 1).reshape(t, self.num_heads * self.head_dim)


FUSED = "_jetrl_fused"
LOW_HEAD = "_jetrl_low_head"


@dataclass
class LowPrecisionWeights:
    """A layer's projection weights in a low-precision dtype, for the matmuls only (cast_linear_weights)."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class FusedProjections:
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor
    low: LowPrecisionWeights | None = None


def fuse_projections(model: Any) -> None:
    """Inference only: store each layer's q/k/v weights as one matrix and gate/up as another, so a step
    runs two matmuls where it ran five (small matmuls waste most of a CPU's time). The modules' own
    weights become views into the fused storage, so ``load_weights_into`` keeps both in step."""
    for layer in model.get_decoder().layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
        if any(type(m) is not torch.nn.Linear for m in projections) or mlp.gate_proj.bias is not None:
            raise ValueError("fuse_projections needs plain nn.Linear projections (no adapters, no MLP bias)")
        with torch.no_grad():
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            bias = None
            if attn.q_proj.bias is not None:
                bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        _repoint(qkv, [attn.q_proj, attn.k_proj, attn.v_proj], "weight")
        if bias is not None:
            _repoint(bias, [attn.q_proj, attn.k_proj, attn.v_proj], "bias")
        _repoint(gate_up, [mlp.gate_proj, mlp.up_proj], "weight")
        setattr(layer, FUSED, FusedProjections(qkv, bias, gate_up))


def cast_linear_weights(model: Any, dtype: torch.dtype | None) -> None:
    """Inference only, after ``fuse_projections``: keep a ``dtype`` copy (bfloat16) of every projection and
    of the LM head, and run the packed forward's matmuls on it. Activations go in and come out in fp32;
    norms, rotary, attention, the residual stream and the softmax stay fp32. On a CPU with bf16 matrix
    units (AMX) a decode step's matmuls run ~2.3x faster than fp32 at batch 32; the policy's numbers move
    by a mean KL of ~0.002 (docs/benchmarks.md). Call again after the fp32 weights change (a new policy
    version); ``dtype=None`` drops the copies."""
    for layer in model.get_decoder().layers:
        fused: FusedProjections = getattr(layer, FUSED)
        fused.low = None if dtype is None else LowPrecisionWeights(
            fused.qkv_weight.to(dtype), layer.self_attn.o_proj.weight.to(dtype), fused.gate_up_weight.to(dtype),
            layer.mlp.down_proj.weight.to(dtype))
    setattr(model, LOW_HEAD, None if dtype is None else model.get_output_embeddings().weight.detach().to(dtype))


def _low_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = F.linear(x.to(weight.dtype), weight).float()
    return out if bias is None else out + bias


def _repoint(storage: torch.Tensor, modules: list[torch.nn.Module], name: str) -> None:
    start = 0
    for module in modules:
        rows = getattr(module, name).shape[0]
        setattr(module, name, torch.nn.Parameter(storage[start: start + rows], requires_grad=False))
        start += rows


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's Llama/Qwen2 RMSNorm as one fused op (the module spells it in seven small ones, which cost more
    than the arithmetic at decode batch sizes)."""
    eps = getattr(norm, "variance_epsilon", None)
    # ZeRO-3 (DeepSpeed trainer) partitions the weight and gathers it only in the module's own forward
    if eps is None or x.dtype != torch.float32 or hasattr(norm.weight, "ds_id"):
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """Log-probability of ``targets`` under ``softmax(logits / temperature)``; the one formula the engine
    (behaviour logprobs) and the trainer (current logprobs) both use."""
    if isinstance(temperature, torch.Tensor):
        if not bool((temperature != 1.0).any()):
            temperature = 1.0
        else:
            temperature = temperature[:, None]
    if not isinstance(temperature, torch.Tensor) and temperature == 1.0:
        scaled = logits  # no copy of a [tokens, vocabulary] tensor for the common case
    else:
        scaled = logits / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
