"""The rollout engine's code split by where it runs (``megatron_rl.rollout.actor``: the engine's
process; ``megatron_rl.rollout.worker``: what vLLM imports into its workers): every module of both
imports, the worker's modules with Ray unimportable (a worker of vLLM's multiprocessing executor
runs without it; ``.importlinter`` checks the import statements, this the imports that run), and
the import paths vLLM loads by name resolve to the classes meant.

One child interpreter does it all: what it imports (vLLM, torch) stays out of the test process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import importlib, json, pkgutil, sys

sys.modules["ray"] = None  # any `import ray` (or of a ray submodule) now raises ImportError

def modules(package):
    pkg = importlib.import_module(package)
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]

out = {"worker": {}, "actor": {}}
for name in modules("megatron_rl.rollout.worker"):
    try:
        importlib.import_module(name)
        out["worker"][name] = "ok"
    except Exception as exc:
        out["worker"][name] = f"{type(exc).__name__}: {exc}"
out["ray_loaded"] = sorted(k for k, v in sys.modules.items() if k.split(".")[0] == "ray" and v is not None)

del sys.modules["ray"]  # the engine's process may use Ray
for name in modules("megatron_rl.rollout.actor"):
    try:
        importlib.import_module(name)
        out["actor"][name] = "ok"
    except Exception as exc:
        out["actor"][name] = f"{type(exc).__name__}: {exc}"

def resolve(path):
    module, _, attr = path.rpartition(".")
    obj = getattr(importlib.import_module(module), attr)
    return f"{obj.__module__}.{obj.__qualname__}"

from megatron_rl.config.schema import RolloutConfig, SpeculativeConfig
from megatron_rl.rollout.actor import speculative, vllm_engine_args
from megatron_rl.rollout.worker import push_receiver, vllm_worker_ext
from vllm.distributed.weight_transfer import WeightTransferEngineFactory

executor = vllm_engine_args.cpu_executor_backend(RolloutConfig(tensor_parallel_size=2))
out["paths"] = {
    "worker_extension_cls": resolve(vllm_worker_ext.EXTENSION),
    "speculative custom_class": resolve(speculative.proposer_class_path(SpeculativeConfig(method="suffix"))),
    "executor": resolve(f"{executor.__module__}.{executor.__qualname__}"),
    "fork window": hasattr(importlib.import_module(vllm_worker_ext.FORK_WINDOW_MODULE), "forked_from"),
    "weight-transfer backend": push_receiver.BACKEND in WeightTransferEngineFactory._registry,
}
print(json.dumps(out))
"""


def _child() -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_actor_and_worker_modules_import_the_worker_ones_without_ray_and_vllm_finds_what_they_name():
    out = _child()
    # The moved modules are found (an empty package would pass the checks below vacuously).
    assert {"megatron_rl.rollout.worker.vllm_worker_ext", "megatron_rl.rollout.worker.push_receiver",
            "megatron_rl.rollout.worker.spec_drafter"} <= set(out["worker"])
    assert {"megatron_rl.rollout.actor.vllm_engine", "megatron_rl.rollout.actor.engine_actor"} <= set(out["actor"])
    assert {k: v for k, v in out["worker"].items() if v != "ok"} == {}, "worker modules must import without Ray"
    assert out["ray_loaded"] == []
    assert {k: v for k, v in out["actor"].items() if v != "ok"} == {}
    assert out["paths"] == {
        "worker_extension_cls": "megatron_rl.rollout.worker.vllm_worker_ext.RankShardReload",
        "speculative custom_class": "megatron_rl.rollout.worker.spec_drafter.SpecDrafter",
        "executor": "megatron_rl.rollout.actor.vllm_cpu_executor.NamedShmExecutor",
        "fork window": True,
        "weight-transfer backend": True,
    }
