"""megatron_rl/tools/convert_checkpoint.py: HF -> Megatron dist checkpoint -> HF is bit-exact, the checkpoint
holds Megatron's own global tensors (so it loads at any layout), legacy formats still export,
clear errors."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.checkpoint.store import CheckpointError  # noqa: E402
from megatron_rl.distributed.process_groups import ParallelLayout  # noqa: E402
from megatron_rl.model.hf_weights import hf_to_megatron_shard, to_te_names  # noqa: E402
from megatron_rl.model.qwen2 import read_qwen2_arch  # noqa: E402
from megatron_rl.resharding import checkpoint_format as fmt  # noqa: E402
from megatron_rl.tools import convert_checkpoint as cc
from megatron_rl.training.weights_io import LazySafetensors  # noqa: E402


def read_hf(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def tensors_metadata(directory: Path) -> dict:
    from megatron.core import dist_checkpointing

    with fmt._offline_megatron():
        return dist_checkpointing.load_tensors_metadata(str(directory))


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_round_trip_is_bit_exact(which, tiny_model_dir, tiny_untied_model_dir, tmp_path):
    hf_dir = Path(tiny_model_dir if which == "tied" else tiny_untied_model_dir)
    mdir = cc.hf_to_megatron(str(hf_dir), str(tmp_path / "meg"))
    assert json.loads((mdir / fmt.META).read_text()) == {"format": fmt.FORMAT, "dtype": "float32"}
    assert (mdir / "metadata.json").is_file() and (mdir / "config.json").is_file()
    out = cc.megatron_to_hf(str(mdir), str(tmp_path / "hf"))
    original, back = read_hf(hf_dir), read_hf(out)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    assert (out / "tokenizer.json").is_file() and not (out / "model.safetensors.index.json").exists()


def test_checkpoint_holds_megatron_global_tensors(tiny_untied_model_dir, tmp_path):
    """What Megatron itself reads back: layers stacked on a leading axis, full (TP1) shapes, the
    norms under their fused-spec names, the output layer only for untied models."""
    arch = read_qwen2_arch(tiny_untied_model_dir)
    meta = tensors_metadata(cc.hf_to_megatron(str(tiny_untied_model_dir), str(tmp_path / "meg")))
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    assert tuple(meta["decoder.layers.self_attention.linear_qkv.weight"].global_shape) == (
        arch.num_layers, qkv_rows, arch.hidden_size)
    assert tuple(meta["decoder.layers.mlp.linear_fc1.weight"].global_shape) == (
        arch.num_layers, 2 * arch.intermediate_size, arch.hidden_size)
    assert tuple(meta["decoder.layers.self_attention.linear_qkv.layer_norm_weight"].global_shape) == (
        arch.num_layers, arch.hidden_size)
    assert meta["embedding.word_embeddings.weight"].global_shape[0] >= arch.vocab_size
    assert "output_layer.weight" in meta


def test_bf16_cast_and_deprecated_layout_flags(tiny_model_dir, tmp_path):
    with pytest.warns(FutureWarning, match="--tp/--pp are deprecated"):
        mdir = cc.hf_to_megatron(str(tiny_model_dir), str(tmp_path / "meg"), 2, 1, dtype="bfloat16")
    assert fmt.read_meta(mdir)["dtype"] == "bfloat16" and fmt.checkpoint_dtype(mdir) == torch.bfloat16
    back = read_hf(cc.megatron_to_hf(str(mdir), str(tmp_path / "hf")))
    original = read_hf(Path(tiny_model_dir))
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], v.bfloat16()) for k, v in original.items())
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3"), pytest.warns(FutureWarning):
        cc.hf_to_megatron(str(tiny_model_dir), str(tmp_path / "bad"), 3, 1)
    with pytest.raises(FileNotFoundError, match="not a checkpoint written by"):
        fmt.read_meta(tmp_path)


def test_reconverting_replaces_the_old_checkpoint(tiny_model_dir, tmp_path):
    from megatron_rl.model.tiny import build_tiny_qwen2

    other = build_tiny_qwen2(tmp_path / "other", seed=7)
    out = tmp_path / "meg"
    cc.hf_to_megatron(str(tiny_model_dir), str(out))
    (out / "model_tp00_pp00.pt").write_bytes(b"stale legacy shard")
    cc.hf_to_megatron(str(other), str(out))
    assert not (out / "model_tp00_pp00.pt").exists()
    back, want = read_hf(cc.megatron_to_hf(str(out), str(tmp_path / "hf"))), read_hf(other)
    assert all(torch.equal(back[k], v) for k, v in want.items())


def test_export_splits_into_safetensors_shards(tiny_untied_model_dir, tmp_path):
    mdir = cc.hf_to_megatron(str(tiny_untied_model_dir), str(tmp_path / "meg"))
    out = cc.megatron_to_hf(str(mdir), str(tmp_path / "hf"), max_shard_gb=0.5 / 1024)  # 512 KiB files
    files = sorted(out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(files) > 1 and set(index["weight_map"].values()) == {f.name for f in files}
    original, back = read_hf(Path(tiny_untied_model_dir)), read_hf(out)
    assert back.keys() == original.keys() and all(torch.equal(back[k], v) for k, v in original.items())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in original.values())


def _write_legacy_conversion(hf_dir: Path, out: Path, tp: int, pp: int) -> None:
    """A checkpoint as the old hf-to-megatron (format v1) wrote it: one torch.save per (TP, PP)."""
    arch, hf = read_qwen2_arch(hf_dir), LazySafetensors(hf_dir)
    out.mkdir()
    for t in range(tp):
        for p in range(pp):
            torch.save(hf_to_megatron_shard(hf, arch, t, tp, p, pp), fmt.shard_file(out, t, p))
    fmt.copy_hf_side_files(hf_dir, out)
    (out / fmt.META).write_text(json.dumps({"format": fmt.LEGACY_FORMAT, "tensor_model_parallel_size": tp,
                                            "pipeline_model_parallel_size": pp, "dtype": "float32"}))


def test_legacy_conversion_still_exports_and_names_the_new_command(tiny_untied_model_dir, tmp_path):
    legacy = tmp_path / "legacy"
    _write_legacy_conversion(Path(tiny_untied_model_dir), legacy, 2, 2)
    assert fmt.is_legacy_converted(legacy)
    back, original = read_hf(cc.megatron_to_hf(str(legacy), str(tmp_path / "hf"))), read_hf(Path(tiny_untied_model_dir))
    assert back.keys() == original.keys() and all(torch.equal(back[k], v) for k, v in original.items())
    with pytest.raises(ValueError, match="converted for TP=2, PP=2 but the trainer runs TP=1, PP=2; convert the HF "
                                         "checkpoint again with megatron-rl-convert-checkpoint hf-to-megatron"):
        fmt.read_converted_shard(legacy, 0, 0, 1, 2)
    with pytest.raises(CheckpointError, match="legacy .* conversion: convert the HF checkpoint again"):
        fmt.find_dist_checkpoint(legacy)


def test_legacy_trainer_checkpoint_exports_dp0_shards(tiny_untied_model_dir, tmp_path):
    """A legacy per-rank trainer checkpoint (DDP-wrapped, TE-named keys, TP2 x PP2 x DP2 on 8
    ranks) exports to HF."""
    arch, hf = read_qwen2_arch(tiny_untied_model_dir), LazySafetensors(tiny_untied_model_dir)
    ckpt = tmp_path / "step_000003"
    ckpt.mkdir()
    layout, tp, dp = ParallelLayout(2, 2, 1), 2, 2
    for rank in range(8):
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        state = hf_to_megatron_shard(hf, arch, tp_rank, 2, pp_rank, 2)
        if dp_rank == 1:  # a stale replica must not be read
            state = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
        model = {f"module.{k}": v for k, v in to_te_names(state).items()}
        model["module.decoder.layers.0.self_attention.core_attention._extra_state"] = None
        torch.save({"model": model, "layout": layout, "world_size": 8}, ckpt / f"megatron_rank{rank:05d}.pt")
    with pytest.raises(ValueError, match="--hf-config"):
        cc.megatron_to_hf(str(ckpt), str(tmp_path / "x"))
    with pytest.raises(CheckpointError, match="legacy per-rank trainer checkpoint"):
        fmt.find_dist_checkpoint(ckpt)
    out = cc.megatron_to_hf(str(ckpt), str(tmp_path / "hf"), hf_config=str(tiny_untied_model_dir))
    original, back = read_hf(Path(tiny_untied_model_dir)), read_hf(out)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], v) for k, v in original.items())


def test_incomplete_checkpoints_are_not_read(tiny_model_dir, tmp_path):
    mdir = cc.hf_to_megatron(str(tiny_model_dir), str(tmp_path / "meg"))
    (mdir / "metadata.json").unlink()  # what an interrupted save leaves: no metadata.json yet
    with pytest.raises(CheckpointError, match="not a dist checkpoint"):
        cc.megatron_to_hf(str(mdir), str(tmp_path / "hf"))
    step = tmp_path / "step_000001"
    (step / fmt.TRAINER_SUBDIR).mkdir(parents=True)
    with pytest.raises(CheckpointError, match="interrupted"):
        fmt.find_dist_checkpoint(step)


def test_cli_runs(tiny_model_dir, tmp_path, capsys):
    assert cc.main(["hf-to-megatron", "--hf", str(tiny_model_dir), "--out", str(tmp_path / "m")]) == 0
    with pytest.warns(FutureWarning):
        assert cc.main(["hf-to-megatron", "--hf", str(tiny_model_dir), "--out", str(tmp_path / "m2"), "--tp", "2"]) == 0
    assert cc.main(["megatron-to-hf", "--megatron", str(tmp_path / "m"), "--out", str(tmp_path / "h")]) == 0
    out = capsys.readouterr().out
    assert "megatron-to-hf: wrote" in out and "--tp/--pp are deprecated" in out
