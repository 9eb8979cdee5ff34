"""Model shapes for planning: parsed from a checkpoint's config.json, or the built-in Qwen2.5
base-model shapes when the checkpoint is not on this machine (a login node, a laptop).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config.values import ConfigError
from megatron_rl.model.arch import Qwen2Arch, arch_from_hf_config


@dataclass(frozen=True)
class ModelShape:
    """A named Qwen2-family architecture and the parameter/KV sizes that memory and time
    estimates derive from it."""

    name: str
    """Display name: a built-in shape's ('Qwen2.5-14B') or the checkpoint directory's."""
    arch: Qwen2Arch
    """The architecture facts, as the trainer parses them from config.json."""

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: QKV (+bias), output proj, SwiGLU MLP, two RMSNorms."""
        h, kv = self.arch.hidden_size, self.arch.num_kv_heads * self.arch.head_dim
        attn = h * (h + 2 * kv) + (h + 2 * kv) + h * h
        mlp = 3 * h * self.arch.intermediate_size
        return attn + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.arch.vocab_size * self.arch.hidden_size

    @property
    def total_params(self) -> int:
        heads = 1 if self.arch.tie_word_embeddings else 2
        return self.arch.num_layers * self.layer_params + heads * self.embedding_params + self.arch.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of one token across all layers (unsharded)."""
        return 2 * self.arch.num_layers * self.arch.num_kv_heads * self.arch.head_dim * 2

    def as_hf_dict(self) -> dict:
        """The config.json keys that ``megatron_rl.config.validation.validate`` checks."""
        a = self.arch
        return {"num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
                "num_hidden_layers": a.num_layers, "max_position_embeddings": a.max_position_embeddings}


def _qwen25_base(name: str, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, eps: float) -> ModelShape:
    """A Qwen2.5 base checkpoint's shape: the family shares vocabulary, context and RoPE base."""
    return ModelShape(name, Qwen2Arch(
        vocab_size=152064, hidden_size=hidden, intermediate_size=ffn, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, max_position_embeddings=131072, rope_theta=1e6, rms_norm_eps=eps,
        tie_word_embeddings=False))


# Published config.json values of the Qwen2.5 *base* checkpoints (Instruct variants have the
# same shapes but max_position_embeddings 32768, too short for the 32k-response recipe).
BUILTIN_SHAPES: dict[str, ModelShape] = {
    "qwen2.5-7b": _qwen25_base("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 1e-6),
    "qwen2.5-14b": _qwen25_base("Qwen2.5-14B", 5120, 13824, 48, 40, 8, 1e-5),
    "qwen2.5-32b": _qwen25_base("Qwen2.5-32B", 5120, 27648, 64, 40, 8, 1e-5),
}


def shape_from_hf_config(raw: dict, name: str) -> ModelShape:
    """ModelShape from a parsed config.json (the trainer's torch-free parser); errors name the key."""
    try:
        return ModelShape(name, arch_from_hf_config(raw, f"config.json of {name}"))
    except ValueError as exc:
        raise ConfigError(f"model.hf_path: {exc}") from None


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
