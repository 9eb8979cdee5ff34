"""Shared fixtures: a tiny random-init Qwen2.5-architecture checkpoint, data paths, GPU gating."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

_SHM_BEFORE = pytest.StashKey[tuple]()
"""/dev/shm's segments, run dirs and engine communicator segments when the session started."""
REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

# Keep vLLM/Ray/torch caches and sockets out of $HOME and the repo.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _controller(config) -> bool:
    """This process runs the session as a whole: pytest without xdist, or xdist's controller
    (its workers have ``workerinput``)."""
    return not hasattr(config, "workerinput")


def pytest_configure(config):
    """Every pytest process (xdist's workers and controller) records asyncio's noise (tests/helpers/noise)."""
    from tests.helpers import noise

    noise.install()


def pytest_sessionstart(session):
    from tests.helpers import noise

    noise.watch_unraisable()  # after pytest's own hook is in place (its pytest_configure)
    if _controller(session.config):
        from tests.helpers import shm

        session.config.stash[_SHM_BEFORE] = (shm.segments(), shm.run_dirs(), shm.engine_segments())


def pytest_sessionfinish(session, exitstatus):
    """Remove the /dev/shm segments and run dirs this session's killed engines and trainer ranks
    could not (see helpers/shm). Only the controller does it, once every worker is done: a worker
    that finished early must not sweep the dead runs another worker's resume test is about to
    check its own start-up sweeps. Every process first collects its garbage: tasks and futures the
    last tests abandoned report themselves now, while tests/helpers/noise records them."""
    from tests.helpers import noise

    noise.flush()
    before = session.config.stash.get(_SHM_BEFORE, None)
    if before is not None:
        from tests.helpers import shm

        segments, dirs, engine_segments = before
        shm.remove_unmapped(shm.segments() - segments)
        shm.remove_dead_run_dirs(shm.run_dirs() - dirs)
        shm.remove_dead_engine_segments(shm.engine_segments() - engine_segments)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """The collection's span on the run's timeline (each xdist worker collects every module)."""
    from tests.helpers import timeline

    start = timeline.now()
    yield
    timeline.record("collect", start, timeline.now())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's span, setup to teardown, on the run's timeline when TEST_TIMELINE is set
    (tests/helpers/timeline)."""
    from tests.helpers import timeline

    start = timeline.now()
    yield
    timeline.record("test", start, timeline.now(), nodeid=item.nodeid)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` hands modules out longest first (tests/helpers/scheduling)."""
    if config.getvalue("dist") == "loadfile":
        from tests.helpers import scheduling

        return scheduling.make_scheduler(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    """Modules longest first (tests/helpers/scheduling); GPU tests skip without a GPU."""
    from tests.helpers import scheduling

    items[:] = scheduling.longest_first(items, scheduling.load_durations())
    skip_gpu = None if _cuda_available() else pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Random-init tiny Qwen2 (tied embeddings): 2 layers, h=128, 4 heads, 2 KV groups."""
    from megatron_rl.model.tiny import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_tied"), seed=0)


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tmp_path_factory) -> Path:
    """Like tiny_model_dir but with a separate lm_head and 4 layers (for PP=2 x 2 layers)."""
    from megatron_rl.model.tiny import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_untied"), seed=1, num_layers=4, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def sft_model_dir() -> Path:
    """The SFT'd tiny model (launch/local.sh's), built once per machine (tests/helpers/sft_model)."""
    from tests.helpers.sft_model import ensure_sft_tiny_model

    return ensure_sft_tiny_model()


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    path = SHARED_DATA / "gsm8k"
    if not (path / "train.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {path} (expected ../shared/data/gsm8k beside the repo)")
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny models' byte-level tokenizer with Qwen's chat template, saved once per session."""
    from megatron_rl.model.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    """That tokenizer, loaded the way reward workers and the trainer load one."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)
