"""tools/convert_checkpoint.py: HF -> Megatron (TP, PP) -> HF is bit-exact; trainer checkpoints
export too; clear errors."""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import convert_checkpoint as cc  # noqa: E402

from megatron_rl.distributed.process_groups import ParallelLayout  # noqa: E402
from megatron_rl.model.hf_weights import to_te_names  # noqa: E402
from megatron_rl.resharding import checkpoint_format as fmt  # noqa: E402


def read_hf(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("which, tp, pp", [("tied", 2, 2), ("tied", 1, 1), ("untied", 2, 4), ("untied", 1, 2)])
def test_round_trip_is_bit_exact(which, tp, pp, tiny_model_dir, tiny_untied_model_dir, tmp_path):
    hf_dir = tiny_model_dir if which == "tied" else tiny_untied_model_dir
    mdir = cc.hf_to_megatron(str(hf_dir), str(tmp_path / "meg"), tp, pp)
    meta = json.loads((mdir / fmt.META).read_text())
    assert (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"], meta["dtype"]) == (tp, pp, "float32")
    assert len(list(mdir.glob("model_tp*_pp*.pt"))) == tp * pp
    shard = fmt.read_converted_shard(mdir, tp - 1, pp - 1, tp, pp)
    assert "decoder.final_layernorm.weight" in shard
    out = cc.megatron_to_hf(str(mdir), str(tmp_path / "hf"))
    original, back = read_hf(Path(hf_dir)), read_hf(out)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == json.loads((Path(hf_dir) / "config.json").read_text())
    assert (out / "tokenizer.json").is_file()
    assert (out / "model.safetensors.index.json").is_file() == (pp > 1)


def test_bf16_cast_and_layout_mismatch_error(tiny_model_dir, tmp_path):
    mdir = cc.hf_to_megatron(str(tiny_model_dir), str(tmp_path / "meg"), 2, 1, dtype="bfloat16")
    assert fmt.read_meta(mdir)["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in fmt.read_converted_shard(mdir, 0, 0, 2, 1).values())
    with pytest.raises(ValueError, match="converted for TP=2, PP=1 but the trainer runs TP=1, PP=2"):
        fmt.read_converted_shard(mdir, 0, 0, 1, 2)
    with pytest.raises(FileNotFoundError, match="not a checkpoint written by"):
        fmt.read_meta(tmp_path)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3"):
        cc.hf_to_megatron(str(tiny_model_dir), str(tmp_path / "bad"), 3, 1)


def test_trainer_checkpoint_exports_dp0_shards(tiny_untied_model_dir, tmp_path):
    """A trainer checkpoint (DDP-wrapped, TE-named keys, TP2 x PP2 x DP2 on 8 ranks) exports to HF."""
    mdir = cc.hf_to_megatron(str(tiny_untied_model_dir), str(tmp_path / "meg"), 2, 2)
    ckpt = tmp_path / "step_000003"
    ckpt.mkdir()
    layout, tp, dp = ParallelLayout(2, 2, 1), 2, 2
    for rank in range(8):
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        state = fmt.read_converted_shard(mdir, tp_rank, pp_rank, 2, 2)
        if dp_rank == 1:  # a stale replica must not be read
            state = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
        model = {f"module.{k}": v for k, v in to_te_names(state).items()}
        model["module.decoder.layers.0.self_attention.core_attention._extra_state"] = None
        torch.save({"model": model, "layout": layout, "world_size": 8}, ckpt / f"megatron_rank{rank:05d}.pt")
    with pytest.raises(ValueError, match="--hf-config"):
        cc.megatron_to_hf(str(ckpt), str(tmp_path / "x"))
    out = cc.megatron_to_hf(str(ckpt), str(tmp_path / "hf"), hf_config=str(tiny_untied_model_dir))
    original, back = read_hf(Path(tiny_untied_model_dir)), read_hf(out)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], v) for k, v in original.items())


def test_cli_runs(tiny_model_dir, tmp_path, capsys):
    assert cc.main(["hf-to-megatron", "--hf", str(tiny_model_dir), "--out", str(tmp_path / "m"), "--tp", "2"]) == 0
    assert cc.main(["megatron-to-hf", "--megatron", str(tmp_path / "m"), "--out", str(tmp_path / "h")]) == 0
    assert "megatron-to-hf: wrote" in capsys.readouterr().out
