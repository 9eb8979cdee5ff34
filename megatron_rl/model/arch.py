"""Qwen2 / Qwen2.5 architecture facts from a Hugging Face config.json (no torch import).

One parser for everything that needs the shape: the trainer, the weight converters and the
cluster planner (which runs on login nodes without torch).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Megatron pads the vocabulary to a multiple of this x TP (its --make-vocab-size-divisible-by).
VOCAB_DIVISIBLE_BY = 128


@dataclass(frozen=True)
class Qwen2Arch:
    """The architecture facts of a Qwen2 HF config.json that the conversion and the planner need."""

    vocab_size: int
    """Unpadded vocabulary (``vocab_size``)."""
    hidden_size: int
    """Model width (``hidden_size``)."""
    intermediate_size: int
    """SwiGLU MLP width (``intermediate_size``)."""
    num_layers: int
    """Decoder layers (``num_hidden_layers``)."""
    num_heads: int
    """Query heads (``num_attention_heads``)."""
    num_kv_heads: int
    """Key/value heads (``num_key_value_heads``; equal to num_heads without GQA)."""
    max_position_embeddings: int
    """Longest supported context (``max_position_embeddings``)."""
    rope_theta: float
    """RoPE base (``rope_theta``)."""
    rms_norm_eps: float
    """RMSNorm epsilon (``rms_norm_eps``)."""
    tie_word_embeddings: bool
    """Whether the output layer shares the input embedding (``tie_word_embeddings``)."""

    @property
    def head_dim(self) -> int:
        """Per-head size (hidden / heads)."""
        return self.hidden_size // self.num_heads


def read_qwen2_arch(hf_path: str | Path) -> Qwen2Arch:
    """Parse ``hf_path/config.json`` of a Qwen2/Qwen2.5 checkpoint; errors name the file and key."""
    path = Path(hf_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model.hf_path: no config.json in {hf_path}")
    raw: dict[str, Any] = json.loads(path.read_text())
    if raw.get("model_type") not in ("qwen2",):
        raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not 'qwen2' (Qwen2/Qwen2.5)")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{path}: use_sliding_window=true is not supported")
    arch = arch_from_hf_config(raw, str(path))
    if arch.hidden_size % arch.num_heads:
        raise ValueError(f"{path}: hidden_size {arch.hidden_size} not divisible by num_attention_heads")
    return arch


def arch_from_hf_config(raw: dict[str, Any], where: str) -> Qwen2Arch:
    """Qwen2Arch from a parsed config.json; ``where`` names the source in errors."""
    rope_theta = raw.get("rope_theta")
    if rope_theta is None:  # transformers 5 may nest it under rope_parameters
        rope_theta = (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    try:
        return Qwen2Arch(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            num_kv_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )
    except KeyError as err:
        raise ValueError(f"{where}: missing key {err.args[0]!r}") from None


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp_size``."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple
