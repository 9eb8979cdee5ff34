"""What the GPU install must import, checked in the GPU venv on a machine with or without a GPU
(tools/check_gpu_install.sh runs it there; it is not meant for the CPU venv).

1. the libraries: torch, vLLM, Ray, modelopt, Megatron-Core;
2. Transformer Engine's core (the transformer-engine-cu13 library, see ``check_te_core``);
3. every module of megatron_rl and rollpacker;
4. every import the project makes inside a function or class (found in the sources with ``ast``):
   the paths a run selects at run time, the GPU ones among them (the NCCL/IPC weight push,
   the TE layer spec, vLLM's worker hooks), which step 3 alone never imports.

Anything that needs transformer-engine-torch, which step 2 of the install compiles with nvcc and
this check does not build, is reported as SKIP with the reason, only when that package is absent
and the error is TE's own "could not find the torch extension". Everything else that fails is a
FAIL, and the exit status is 1.
"""
from __future__ import annotations

import ast
import importlib
import importlib.metadata
import pkgutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("megatron_rl", "rollpacker")
LIBRARIES = ("torch", "vllm", "ray", "modelopt.torch.quantization", "megatron.core")
TE_TORCH = "transformer-engine-torch"

counts = {"ok": 0, "SKIP": 0, "FAIL": 0}


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _needs_te_torch(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) is TE's missing PyTorch extension (transformer_engine/
    common/__init__.py, _get_shared_object_file('torch')) while transformer-engine-torch is absent."""
    while exc is not None:
        if "shared object file for Transformer Engine torch lib" in str(exc) and not _installed(TE_TORCH):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def report(status: str, what: str, seconds: float, detail: str = "") -> None:
    counts[status] += 1
    print(f"  {status:<4} {seconds:5.1f}s  {what}{'  -- ' + detail if detail else ''}", flush=True)


def check(what: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        detail = fn() or ""
    except BaseException as exc:  # noqa: BLE001 -- SystemExit/OSError from a native load are failures too
        if isinstance(exc, KeyboardInterrupt):
            raise
        message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        if _needs_te_torch(exc):
            report("SKIP", what, time.perf_counter() - t0, f"needs {TE_TORCH} (install step 2, nvcc): {message}")
        else:
            report("FAIL", what, time.perf_counter() - t0, message)
        return
    report("ok", what, time.perf_counter() - t0, detail)


def import_names(module: str, names: tuple[str, ...] = ()) -> str:
    """``import module`` / ``from module import names`` (a name may be a submodule)."""
    mod = importlib.import_module(module)
    for name in names:
        if name != "*" and not hasattr(mod, name):
            importlib.import_module(f"{module}.{name}")
    return ""


def torch_info() -> str:
    import torch

    return f"torch {torch.__version__}, CUDA {torch.version.cuda} build, GPU visible: {torch.cuda.is_available()}"


def check_te_core() -> str:
    """transformer_engine.common: loads cuDNN, NVRTC, cuRAND, cuBLAS and the CUDA runtime (from the
    system or the nvidia-* wheels), then the core library (libtransformer_engine.so)."""
    import transformer_engine.common as te_common

    core = te_common._get_shared_object_file("core")
    package = te_common.get_te_core_package_info()[1]
    return f"{package}: {core.relative_to(core.parents[2])}"


def project_modules() -> list[str]:
    names = []
    for top in PROJECT:
        package = importlib.import_module(top)
        names.append(top)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, f"{top}.")]
    return sorted(names)


def deferred_imports() -> dict[tuple[str, tuple[str, ...]], list[str]]:
    """{(module, names): [files]} of the absolute imports the project makes below module level,
    except a sandbox script's imports of its sibling files (run with their own sys.path)."""
    found: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for top in PROJECT:
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            module_level = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                if id(node) in module_level or not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                if isinstance(node, ast.ImportFrom):
                    if node.level or node.module is None:
                        continue
                    keys = [(node.module, tuple(a.name for a in node.names))]
                else:
                    keys = [(a.name, ()) for a in node.names]
                for key in keys:
                    if (path.parent / f"{key[0].split('.')[0]}.py").is_file():
                        continue
                    found.setdefault(key, []).append(str(path.relative_to(ROOT)))
    return found


def main() -> int:
    t0 = time.perf_counter()
    print(f"[imports] Python {sys.version.split()[0]} at {sys.executable}")
    print("[imports] libraries")
    check("torch", torch_info)
    check("transformer_engine.common (Transformer Engine's core library)", check_te_core)
    for name in LIBRARIES[1:]:
        check(name, lambda name=name: import_names(name))
    check("transformer_engine.pytorch", lambda: import_names("transformer_engine.pytorch"))
    modules = project_modules()
    print(f"[imports] the project's {len(modules)} modules")
    for name in modules:
        check(name, lambda name=name: import_names(name))
    deferred = deferred_imports()
    print(f"[imports] the {len(deferred)} imports the project makes inside functions (run-time paths)")
    for (module, names), files in sorted(deferred.items()):
        what = f"from {module} import {', '.join(names)}" if names else f"import {module}"
        check(f"{what}  ({files[0]}{f' +{len(files) - 1}' if len(files) > 1 else ''})",
              lambda module=module, names=names: import_names(module, names))
    print(f"[imports] {counts['ok']} ok, {counts['SKIP']} skipped, {counts['FAIL']} failed "
          f"in {time.perf_counter() - t0:.0f}s")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
