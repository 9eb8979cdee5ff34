"""tools/check_gpu_install_imports.py, the GPU install's import check (CI runs it in the GPU venv
through tools/check_gpu_install.sh): its rules, checked here on the CPU venv with fakes, so a change
that makes it pass without looking fails here first."""
from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_gpu_install_imports", REPO / "tools/check_gpu_install_imports.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def test_the_deferred_imports_include_the_gpu_paths_and_leave_out_sandbox_siblings():
    found = check.deferred_imports()
    modules = {module for module, _ in found}
    # The weight push's CUDA IPC and NCCL wires, imported only when the channel is a GPU one.
    assert ("torch.multiprocessing.reductions", ("reduce_tensor",)) in found
    assert ("vllm.distributed.weight_transfer.nccl_common", ("stateless_init_process_group",)) in found
    assert any(m == "megatron_rl.rollout.weight_sync.push.channels_gpu" for m in modules)
    assert "transformer_engine" in modules  # model.transformer_impl=auto on a GPU
    # The confined sandbox's scripts import their sibling files by bare name: not library imports.
    assert not {"sandbox_wire", "sandbox_confine", "sandbox_server"} & modules
    assert check.script_style("megatron_rl.reward.sandbox.confined.sandbox_server")
    assert not check.script_style("megatron_rl.rollout.weight_sync.push.channels_gpu")


class _Record(str):
    """A RECORD entry as importlib.metadata gives it: the path, with its hash."""

    def __new__(cls, path: str, digest: str) -> _Record:
        record = super().__new__(cls, path)
        record.hash = SimpleNamespace(value=digest)
        return record


def _dist(name: str, files: dict[str, str]) -> SimpleNamespace:
    return SimpleNamespace(metadata={"Name": name}, files=[_Record(p, d) for p, d in files.items()])


def test_file_clashes_fail_on_different_contents_only(monkeypatch):
    same = [_dist("transformer_engine", {"transformer_engine/__init__.py": "a"}),
            _dist("transformer_engine_cu13", {"transformer_engine/__init__.py": "a"}),
            _dist("flashinfer-python", {"build_backend.py": "x"}), _dist("torch_c_dlpack_ext", {"build_backend.py": "y"})]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: same)
    assert check.check_file_clashes() == "2 files checked"  # same contents, or the allowed build_backend.py
    clash = [_dist("cuda-bindings", {"cuda/bindings/runtime.so": "13", "cuda/bindings/driver.so": "13"}),
             _dist("cuda-python", {"cuda/bindings/runtime.so": "12", "cuda/bindings/driver.so": "12"})]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: clash)
    with pytest.raises(RuntimeError, match="cuda-bindings and cuda-python both install 2 files"):
        check.check_file_clashes()


def test_only_te_s_missing_torch_extension_is_a_skip():
    assert not check._installed(check.TE_TORCH)  # the CPU venv has no Transformer Engine
    missing = FileNotFoundError("Could not find shared object file for Transformer Engine torch lib.")
    assert check._needs_te_torch(missing)
    try:
        raise ImportError("megatron.core failed") from missing
    except ImportError as chained:
        assert check._needs_te_torch(chained)
    assert check._needs_te_torch(ModuleNotFoundError(f"transformer_engine {check.HIDDEN}"))
    assert not check._needs_te_torch(AttributeError("module 'cuda.bindings.runtime' has no attribute 'cudaLibrary_t'"))
    assert not check._needs_te_torch(OSError("libcublas.so.12: cannot open shared object file"))


def test_the_library_names_in_strings_resolve_as_module_or_attribute():
    named = check.named_in_strings()
    assert "vllm.v1.engine.utils" in named  # engine_start imports vLLM's launchers by name
    assert check.import_dotted("json.decoder") == "" and check.import_dotted("json.decoder.JSONDecoder") == ""
    with pytest.raises(AttributeError, match="json.decoder has no Nothing"):
        check.import_dotted("json.decoder.Nothing")
