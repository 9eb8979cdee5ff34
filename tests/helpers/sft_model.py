"""The SFT'd tiny model that ``launch/local.sh`` trains (``artifacts/tiny-qwen2.5``), for the
tests that need a policy whose responses make sense (e.g. speculation: drafts are accepted only
where a prompt's responses repeat). Built here when absent (~3-5 min on 2 cores, once: later
runs and ``launch/local.sh`` reuse it), so a new machine runs these tests instead of skipping
them. A lock keeps two processes from building it at the same time; the build itself swaps the
finished directory in atomically (``megatron-rl-make-tiny-model``)."""
from __future__ import annotations

import fcntl
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SFT_MODEL = REPO / "artifacts" / "tiny-qwen2.5"
"""Where launch/local.sh builds and reads the model."""


def ensure_sft_tiny_model() -> Path:
    """``SFT_MODEL``, built first when it has no ``config.json``."""
    if (SFT_MODEL / "config.json").is_file():
        return SFT_MODEL
    SFT_MODEL.parent.mkdir(parents=True, exist_ok=True)
    with open(SFT_MODEL.parent / f".{SFT_MODEL.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (SFT_MODEL / "config.json").is_file():  # another process may have built it meanwhile
            from megatron_rl.tools.make_tiny_model import make_tiny_model

            print(f"\n[tests] building the SFT'd tiny model in {SFT_MODEL} (one-off, a few minutes)", flush=True)
            make_tiny_model(SFT_MODEL, progress=False)
    return SFT_MODEL
