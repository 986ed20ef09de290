"""``deepspeed.utils.zero_to_fp32`` over zeroshard's offline reader: the state dicts it returns and the files
it writes hold the trained fp32 weights, from zeroshard's checkpoints and from DeepSpeed's layout alike, and
a missing ``latest`` or tag is the error DeepSpeed raises."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.models import batch, make_model
from zeroshard.checkpoint import get_fp32_state_dict
from zeroshard.checkpoint.tensorfile import TensorFile
from zeroshard.deepspeed import initialize
from zeroshard.deepspeed.utils import zero_to_fp32 as z2f

pytestmark = pytest.mark.timeout(240)


def save_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Train a few steps at stage 3 and save in both layouts; return the live fp32 weights (rank 0), as
    lists (tensors would travel as file descriptors, gone once the worker exits)."""
    model = make_model(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(2):
        engine.backward(engine(*batch(step, 0, rank)))
        engine.step()
    engine.save_checkpoint(os.path.join(root, "zeroshard"))
    engine.save_checkpoint(os.path.join(root, "deepspeed"), format="deepspeed")
    return {k: v.float().tolist() for k, v in engine._zero3_consolidated_16bit_state_dict().items()}


def test_state_dicts_and_files_from_both_layouts(tmp_path: Path) -> None:
    live = {k: torch.tensor(v) for k, v in run_distributed(save_worker, 2, str(tmp_path))[0].items()}
    trained = {k for k, p in make_model(0).named_parameters() if p.requires_grad}
    for layout in ("zeroshard", "deepspeed"):
        root = str(tmp_path / layout)
        state = z2f.get_fp32_state_dict_from_zero_checkpoint(root)
        assert state.keys() == get_fp32_state_dict(root).keys()
        for key in trained:
            assert state[key].dtype == torch.float32
            torch.testing.assert_close(state[key], live[key], rtol=0, atol=0, msg=f"{layout} {key}")
        assert state["head.weight"] is state["emb.weight"]  # tied names share one tensor
        assert "frozen.weight" in state
        lean = z2f.get_fp32_state_dict_from_zero_checkpoint(root, exclude_frozen_parameters=True)
        assert "frozen.weight" not in lean and trained <= lean.keys()
        assert z2f.get_fp32_state_dict_from_zero_checkpoint(root, lazy_mode=True).keys() == state.keys()

        model = z2f.load_state_dict_from_zero_checkpoint(make_model(1), root)
        for key in trained:
            torch.testing.assert_close(model.state_dict()[key], live[key], rtol=0, atol=0)

        pickles = tmp_path / f"{layout}-bin"
        assert z2f.convert_zero_checkpoint_to_fp32_state_dict(root, pickles) == ["pytorch_model.bin"]
        loaded = torch.load(pickles / "pytorch_model.bin", weights_only=True)
        assert "head.weight" not in loaded  # a tied weight is written once
        for key in trained - {"head.weight"}:
            torch.testing.assert_close(loaded[key], live[key], rtol=0, atol=0)

        shards = tmp_path / f"{layout}-st"
        names = z2f.convert_zero_checkpoint_to_state_dict(
            root, shards, dtype="bf16", max_shard_size=400, safe_serialization=True
        )
        assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
        index = json.loads((shards / "model.safetensors.index.json").read_text())
        key = "lin1.weight"
        with TensorFile(str(shards / index["weight_map"][key])) as f:
            got = f.read_tensor(key)
        assert got.dtype == torch.bfloat16 and torch.equal(got, live[key].bfloat16())

        sharded_bin = tmp_path / f"{layout}-bin-sharded"
        names = z2f.convert_zero_checkpoint_to_fp32_state_dict(root, sharded_bin, max_shard_size=400)
        index = json.loads((sharded_bin / "pytorch_model.bin.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == names and len(names) > 1

    # The file helpers Lightning's convert_zero_checkpoint_to_fp32_state_dict reads client state through.
    tag = tmp_path / "deepspeed" / (tmp_path / "deepspeed" / "latest").read_text().strip()
    optim = z2f.get_optim_files(tag)
    # fp32 training: no bf16_ prefix
    assert [Path(f).name for f in optim] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    stage = torch.load(optim[0], map_location="cpu", weights_only=False)["optimizer_state_dict"]["zero_stage"]
    model_file = z2f.get_model_state_file(tag, stage)
    assert Path(model_file).name == "zero_pp_rank_0_mp_rank_00_model_states.pt"
    assert model_file in z2f.get_model_state_files(tag)
    with pytest.raises(FileNotFoundError, match="can't find model states file"):
        z2f.get_model_state_file(tag, 1)
    with pytest.raises(FileNotFoundError, match=r"_optim_states\.pt files"):
        z2f.get_optim_files(tmp_path / "zeroshard")


def test_missing_latest_and_missing_tag_are_deepspeeds_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no 'latest' file"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("global_step3")
    with pytest.raises(FileNotFoundError, match="global_step9"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="global_step9")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="dtype"):
        z2f.convert_zero_checkpoint_to_state_dict(tmp_path, tmp_path / "out", dtype="int8")
