"""What the GPU install must import, checked in the GPU venv on a machine with or without a GPU
(tools/check_gpu_install.sh runs it there; it is not meant for the CPU venv).

0. no file is installed by two wheels with different contents (``check_file_clashes``);
1. the libraries: torch, vLLM, Ray, modelopt, Megatron-Core;
2. Transformer Engine's core (the transformer-engine-cu13 library, see ``check_te_core``);
3. every module of megatron_rl and rollpacker;
4. every import the project makes inside a function or class (found in the sources with ``ast``):
   the paths a run selects at run time, the GPU ones among them (the NCCL/IPC weight push,
   the TE layer spec, vLLM's worker hooks), which step 3 alone never imports;
5. the library modules and attributes the project names in strings (``importlib.import_module``
   lists, patch targets).

Transformer Engine's PyTorch extension (transformer-engine-torch) is compiled with nvcc by step 2
of the install. Where it is absent (tools/check_gpu_install.sh does not build it), importing
``transformer_engine.pytorch`` raises FileNotFoundError, which Megatron-Core does not catch
(megatron/core/tensor_parallel/random.py catches only ModuleNotFoundError), so no module that
imports megatron.core could be checked. The core library is then checked in a child process, and
this process hides ``transformer_engine`` (ModuleNotFoundError, as if TE were not installed,
which Megatron-Core supports: its HAVE_TE flags) so that Megatron-Core and the project are
checked without TE's layers; the imports of TE itself are reported as SKIP with the reason.
Where the extension is installed (a full GPU install) nothing is hidden. Every other failure is a
FAIL, and the exit status is 1. Modules run as scripts with their own directory on sys.path
(the reward sandbox's confined helpers, which import their sibling files by bare name) are
SKIP: they are not importable as modules by design, and the CPU test suite runs them.
"""
from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import pkgutil
import re
import subprocess
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


HIDDEN = "hidden by tools/check_gpu_install_imports.py: transformer-engine-torch is not installed"


class HideTransformerEngine(importlib.abc.MetaPathFinder):
    """Makes ``transformer_engine*`` unimportable (ModuleNotFoundError), as without TE installed."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 -- the finder protocol
        if name.split(".")[0] in ("transformer_engine", "transformer_engine_torch"):
            raise ModuleNotFoundError(f"{name} {HIDDEN}", name=name)
        return None


def _needs_te_torch(exc: BaseException | None) -> bool:
    """True when ``exc`` (or what caused it) is TE's missing PyTorch extension (transformer_engine/
    common/__init__.py, _get_shared_object_file('torch')) or our hiding of TE, with
    transformer-engine-torch absent."""
    while exc is not None:
        if ("shared object file for Transformer Engine torch lib" in str(exc) or HIDDEN in str(exc)) \
                and not _installed(TE_TORCH):
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


# Files that two wheels both ship with different contents, known to be harmless: an in-tree PEP 517
# backend that flashinfer-python and torch_c_dlpack_ext leave at the top of site-packages (nothing
# imports it at run time).
CLASH_ALLOWED = {"build_backend.py"}


def check_file_clashes() -> str:
    """No file installed by two distributions with different contents (per their RECORD hashes):
    the one installed last silently wins (TE's cu12 core over cu13, cuda-python 12's
    cuda/bindings over cuda-bindings 13's)."""
    owners: dict[str, dict[str, str | None]] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        for file in dist.files or []:
            path = str(file)
            if "__pycache__" not in path and ".dist-info/" not in path:
                owners.setdefault(path, {})[name] = file.hash.value if file.hash else None
    clashes: dict[tuple[str, ...], list[str]] = {}
    for path, by_dist in owners.items():
        if len(set(by_dist.values())) > 1 and path not in CLASH_ALLOWED:
            clashes.setdefault(tuple(sorted(by_dist)), []).append(path)
    if clashes:
        raise RuntimeError("; ".join(f"{' and '.join(d)} both install {len(p)} files, e.g. {p[0]}"
                                     for d, p in clashes.items()))
    return f"{len(owners)} files checked"


def torch_info() -> str:
    import torch

    return f"torch {torch.__version__}, CUDA {torch.version.cuda} build, GPU visible: {torch.cuda.is_available()}"


# Run in a child process: importing transformer_engine.common loads cuDNN, NVRTC, cuRAND, cuBLAS
# and the CUDA runtime (from the system or the nvidia-* wheels), then the core library
# (transformer_engine/common/__init__.py, _load_core_library). The child then lists what the
# process mapped: the core's CUDA libraries, and whether the driver's libcuda was needed (the core
# library does not link it; it opens libcuda.so with dlopen when it first calls the driver API).
_TE_CORE_CHILD = """
import transformer_engine.common as c
core = c._get_shared_object_file("core")
maps = {line.split()[-1] for line in open("/proc/self/maps") if len(line.split()) == 6}
needed = ("libcudart.so", "libcublas.so", "libcublasLt.so", "libcudnn.so")  # the core's CUDA NEEDED entries
found = sorted({m.split("site-packages/")[-1] for m in maps if m.rsplit("/", 1)[-1].startswith(needed)})
driver = sorted(m for m in maps if m.rsplit("/", 1)[-1].startswith("libcuda.so"))
print(f"{c.get_te_core_package_info()[1]} {core.parent.name}/{core.name} loaded with {', '.join(found)}; "
      f"the driver's libcuda loaded: {driver or 'no'}")
"""


def check_te_core() -> str:
    proc = subprocess.run([sys.executable, "-c", _TE_CORE_CHILD], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["no output"])[-1])
    return proc.stdout.strip()


def check_te_pytorch() -> str:
    """transformer_engine.pytorch in a child: SKIP (its message) when the extension is absent."""
    proc = subprocess.run([sys.executable, "-c", "import transformer_engine.pytorch"], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        kind, _, message = (proc.stderr.strip().splitlines() or ["no output"])[-1].partition(": ")
        raise (FileNotFoundError if kind == "FileNotFoundError" else RuntimeError)(message or kind)
    return ""


def script_style(module: str) -> bool:
    """A file that imports a sibling file by bare name at module level (run as a script)."""
    path = Path(importlib.util.find_spec(module).origin)
    for node in ast.parse(path.read_text()).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
        if any((path.parent / f"{n.split('.')[0]}.py").is_file() for n in names):
            return True
    return False


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


# Dotted names of these libraries in the project's string literals: modules it imports by name
# (importlib.import_module, patch targets) and the functions and classes it names that way.
_LIBRARY_NAME = re.compile(r"^(vllm|megatron|torch|ray|transformer_engine|modelopt|flashinfer)(\.[A-Za-z_]\w*)+$")


def named_in_strings() -> dict[str, list[str]]:
    """{dotted name: [files]} of the library names the project writes as strings."""
    found: dict[str, list[str]] = {}
    for top in PROJECT:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and _LIBRARY_NAME.match(node.value):
                    found.setdefault(node.value, []).append(str(path.relative_to(ROOT)))
    return found


def import_dotted(name: str) -> str:
    """``name`` as a module, else as ``module.attribute``."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        module, _, attr = name.rpartition(".")
        if not hasattr(importlib.import_module(module), attr):
            raise AttributeError(f"{module} has no {attr}") from None
    return ""


def main() -> int:
    t0 = time.perf_counter()
    print(f"[imports] Python {sys.version.split()[0]} at {sys.executable}")
    check("no file installed by two distributions with different contents", check_file_clashes)
    print("[imports] libraries")
    check("torch", torch_info)
    check("transformer_engine.common: Transformer Engine's core library (child process)", check_te_core)
    check("transformer_engine.pytorch (child process)", check_te_pytorch)
    if not _installed(TE_TORCH):
        sys.meta_path.insert(0, HideTransformerEngine())
        print(f"[imports] {TE_TORCH} is not installed (install step 2): transformer_engine is hidden from now on, "
              "Megatron-Core runs without TE (HAVE_TE=False)")
    for name in LIBRARIES[1:]:
        check(name, lambda name=name: import_names(name))
    modules = project_modules()
    print(f"[imports] the project's {len(modules)} modules")
    for name in modules:
        if script_style(name):
            report("SKIP", name, 0.0, "a script: imports its sibling files by bare name (run with its own sys.path)")
        else:
            check(name, lambda name=name: import_names(name))
    deferred = deferred_imports()
    print(f"[imports] the {len(deferred)} imports the project makes inside functions (run-time paths)")
    for (module, names), files in sorted(deferred.items()):
        what = f"from {module} import {', '.join(names)}" if names else f"import {module}"
        check(f"{what}  ({files[0]}{f' +{len(files) - 1}' if len(files) > 1 else ''})",
              lambda module=module, names=names: import_names(module, names))
    named = named_in_strings()
    print(f"[imports] the {len(named)} library names the project writes as strings (imported by name, patched)")
    for name, files in sorted(named.items()):
        check(f"{name}  ({files[0]}{f' +{len(files) - 1}' if len(files) > 1 else ''})",
              lambda name=name: import_dotted(name))
    print(f"[imports] {counts['ok']} ok, {counts['SKIP']} skipped, {counts['FAIL']} failed "
          f"in {time.perf_counter() - t0:.0f}s")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
