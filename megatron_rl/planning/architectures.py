"""Model shapes for planning: parsed from a checkpoint's config.json, or the built-in Qwen2.5
base-model shapes when the checkpoint is not on this machine (a login node, a laptop).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config_io import ConfigError
from megatron_rl.model.arch import arch_from_hf_config


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers that memory and time estimates need (a Qwen2-family decoder)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: QKV (+bias), output proj, SwiGLU MLP, two RMSNorms."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * (h + 2 * kv) + (h + 2 * kv) + h * h
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * self.layer_params + heads * self.embedding_params + self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of one token across all layers (unsharded)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    def as_hf_dict(self) -> dict:
        """The config.json keys that ``megatron_rl.config_io.validate`` checks."""
        return {"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "num_hidden_layers": self.num_layers, "max_position_embeddings": self.max_position_embeddings}


# Published config.json values of the Qwen2.5 *base* checkpoints (Instruct variants have the
# same shapes but max_position_embeddings 32768, too short for the 32k-response recipe).
BUILTIN_SHAPES: dict[str, ModelShape] = {
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 152064, 3584, 18944, 28, 28, 4, 131072, False),
    "qwen2.5-14b": ModelShape("Qwen2.5-14B", 152064, 5120, 13824, 48, 40, 8, 131072, False),
    "qwen2.5-32b": ModelShape("Qwen2.5-32B", 152064, 5120, 27648, 64, 40, 8, 131072, False),
}


def shape_from_hf_config(raw: dict, name: str) -> ModelShape:
    """ModelShape from a parsed config.json (the trainer's torch-free parser); errors name the key."""
    try:
        arch = arch_from_hf_config(raw, f"config.json of {name}")
    except ValueError as exc:
        raise ConfigError(f"model.hf_path: {exc}") from None
    return ModelShape(
        name=name, vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_layers=arch.num_layers, num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads, max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
    )


def resolve_shape(hf_path: str) -> ModelShape:
    """The shape of ``hf_path``: its config.json when present, else a built-in Qwen2.5 shape
    matched on the directory name (e.g. '/models/Qwen2.5-14B' -> qwen2.5-14b)."""
    cfg_file = Path(hf_path) / "config.json"
    if cfg_file.is_file():
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model.hf_path: {cfg_file} is not valid JSON: {exc}") from None
        return shape_from_hf_config(raw, Path(hf_path).name or str(hf_path))
    match = re.search(r"qwen2\.5[-_](?:math[-_])?(\d+)b", Path(hf_path).name.lower())
    key = f"qwen2.5-{match.group(1)}b" if match else ""
    if key not in BUILTIN_SHAPES:
        known = ", ".join(s.name for s in BUILTIN_SHAPES.values())
        raise ConfigError(f"model.hf_path: {hf_path} has no config.json and its name matches none of the "
                          f"built-in shapes ({known}); point it at a checkpoint directory")
    return BUILTIN_SHAPES[key]
