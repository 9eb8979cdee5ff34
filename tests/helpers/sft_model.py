"""The SFT'd tiny model (what ``launch/local.sh`` trains into ``artifacts/tiny-qwen2.5``), for the
tests that need a policy whose responses make sense (e.g. speculation: drafts are accepted only
where a prompt's responses repeat).

Built once per machine, not once per clone: the model lands in a cache directory outside the
checkout (``~/.cache/rollpacker-megatron/models/``, or ``$ROLLPACKER_MODEL_CACHE``) under a key
of everything its weights depend on: the build settings (seed, steps, batch, learning rate,
shape, re-check style, thread count), the torch and transformers versions and the source of the
code that builds it. A change to any of them is another key, so a stale model can never stand in
for the one a clone would build (tests/run.sh points every other cache into its temp root; this
one is kept on purpose: the build costs ~3 min of the suite's 2 cores). A lock keeps two
processes from building the same key at once; the build writes a temporary sibling and renames it
into place (``make_tiny_model``), so a reader sees the whole model or none."""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BUILD_SOURCES = ("megatron_rl/tools/make_tiny_model.py", "megatron_rl/model/tiny.py", "megatron_rl/data/arithmetic.py",
                 "megatron_rl/data/datasets.py")
"""The code the weights are a function of: the SFT loop, the random init and tokenizer, the
arithmetic problems and the chat template."""


def cache_root() -> Path:
    """Where built models are kept: ``$ROLLPACKER_MODEL_CACHE`` or ``~/.cache/rollpacker-megatron/models``
    (not ``$XDG_CACHE_HOME``: tests/run.sh points that into the run's temp root)."""
    configured = os.environ.get("ROLLPACKER_MODEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "rollpacker-megatron" / "models"


@dataclass(frozen=True)
class SFTBuild:
    """The arguments of ``make_tiny_model`` that the weights depend on (its defaults: the model
    ``launch/local.sh`` builds)."""

    seed: int = 0
    """Init, data order and sampling seed."""
    sft_steps: int = 400
    """Supervised steps."""
    batch_size: int = 32
    """Problems per step."""
    lr: float = 3e-3
    """Peak learning rate."""
    eval_prompts: int = 48
    """Held-out problems the report scores (the weights do not depend on it; the report does)."""
    num_threads: int = 2
    """Torch threads of the build: the result is deterministic at a fixed thread count only."""
    shape: dict = field(default_factory=dict)
    """``ModelShape`` fields that differ from its defaults."""
    recheck: dict = field(default_factory=dict)
    """``RecheckStyle`` fields that differ from its defaults (none: the default model)."""

    def inputs(self) -> dict:
        """Everything the key covers, resolved (defaults filled in, versions, source hashes)."""
        import torch
        import transformers

        from megatron_rl.tools.make_tiny_model import ModelShape, RecheckStyle

        settings = dataclasses.asdict(self)
        settings["shape"] = dataclasses.asdict(ModelShape(**self.shape))
        settings["recheck"] = dataclasses.asdict(RecheckStyle(**self.recheck))
        sources = {name: hashlib.sha256((REPO / name).read_bytes()).hexdigest() for name in BUILD_SOURCES}
        return {"settings": settings, "torch": torch.__version__, "transformers": transformers.__version__,
                "sources": sources}

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.inputs(), sort_keys=True).encode()).hexdigest()[:20]

    def directory(self) -> Path:
        return cache_root() / f"tiny-qwen2.5-sft-{self.key()}"


DEFAULT_BUILD = SFTBuild()
"""The model launch/local.sh trains (``megatron-rl-make-tiny-model`` with its defaults)."""


def ensure_sft_tiny_model(build: SFTBuild = DEFAULT_BUILD) -> Path:
    """The directory of ``build``'s model, built first on a machine that has none for its key."""
    out = build.directory()
    if (out / "make_tiny_model.json").is_file():  # written before the rename: the model is whole
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "make_tiny_model.json").is_file():  # another process may have built it meanwhile
            from megatron_rl.tools.make_tiny_model import ModelShape, RecheckStyle, make_tiny_model

            print(f"\n[tests] building the SFT'd tiny model in {out} (once per machine, a few minutes)", flush=True)
            make_tiny_model(out, seed=build.seed, sft_steps=build.sft_steps, batch_size=build.batch_size, lr=build.lr,
                            eval_prompts=build.eval_prompts, num_threads=build.num_threads,
                            shape=ModelShape(**build.shape), progress=False, style=RecheckStyle(**build.recheck))
            (out.parent / f"{out.name}.inputs.json").write_text(json.dumps(build.inputs(), indent=2, sort_keys=True) + "\n")
    return out


def main() -> int:
    """``python -m tests.helpers.sft_model``: the model's directory, built first where it is missing
    (tests/run.sh calls it before the tests, so no test waits on the build)."""
    out = DEFAULT_BUILD.directory()
    if not (out / "make_tiny_model.json").is_file():
        print(f"tests/run.sh: this machine has no SFT'd tiny model for this checkout yet; building it once into {out} "
              "(about 5 minutes of both cores; kept for later runs, ROLLPACKER_MODEL_CACHE moves it)", flush=True)
    print(f"tests/run.sh: the SFT'd tiny model: {ensure_sft_tiny_model()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
