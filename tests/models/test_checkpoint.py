"""Checkpoint conversion: TP weight layout round trips, byte-identical export, buckets, clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from stacx.launch.cli import main as stacx_main
from stacx.models.architectures import decoder_shape
from stacx.models.testing import build_tiny_hf_model, save_tiny_hf_checkpoint, tiny_hf_config
from stacx.models.weight_mapping import Slice, expected_param_mappings
from stacx.testing.distributed import run_distributed


def _read_hf_folder(folder: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, file)))
    return tensors


def _assert_identical(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


def _slice(tensor: torch.Tensor, part: Slice) -> torch.Tensor:
    if part.dim is None:
        return tensor
    return tensor[part.start : part.stop] if part.dim == 0 else tensor[:, part.start : part.stop]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_sharding_then_merging_gives_back_every_hf_tensor(arch, tp_size):
    config = tiny_hf_config(arch, tie_word_embeddings=arch == "qwen3")
    state = build_tiny_hf_model(config, seed=3).state_dict()
    shape = decoder_shape(config)
    for mapping in expected_param_mappings(shape, tp_size):
        shards = []
        for rank in range(tp_size):
            parts = mapping.local_slices(shape, rank, tp_size)
            shard = mapping.assemble_local([_slice(state[n], p) for n, p in zip(mapping.hf_names, parts)], shape, tp_size)
            assert tuple(shard.shape) == mapping.local_shape, mapping.megatron_name
            shards.append(shard)
        for name, merged in zip(mapping.hf_names, mapping.merge_shards(shards, shape)):
            assert torch.equal(merged, state[name]), name


def test_qkv_shard_holds_whole_kv_groups_in_megatron_order():
    # 4 query heads, 2 KV groups, head_dim 1: rank r must hold [q(2r), q(2r+1), k(r), v(r)].
    config = tiny_hf_config("llama", hidden_size=4, num_attention_heads=4, num_key_value_heads=2, head_dim=1)
    shape = decoder_shape(config)
    mapping = next(m for m in expected_param_mappings(shape, 2) if m.kind == "qkv")
    q, k, v = torch.arange(4.0)[:, None], 10 + torch.arange(2.0)[:, None], 20 + torch.arange(2.0)[:, None]
    shards = [
        mapping.assemble_local([_slice(t, p) for t, p in zip((q, k, v), mapping.local_slices(shape, r, 2))], shape, 2)
        for r in range(2)
    ]
    assert shards[0].flatten().tolist() == [0, 1, 10, 20]
    assert shards[1].flatten().tolist() == [2, 3, 11, 21]


@pytest.mark.slow
def test_convert_command_round_trip_is_byte_identical_and_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_in, dist_dir, hf_out, dist_again, hf_again = (
        str(tmp_path / n) for n in ("hf_in", "dist", "hf_out", "dist2", "hf_again"))
    save_tiny_hf_checkpoint(hf_in, "qwen2", seed=4)
    assert stacx_main(["convert", "hf-to-torch-dist", "--hf-checkpoint", hf_in, "--out", dist_dir]) == 0
    # A tiny shard size forces an index file plus several shards on export ...
    assert stacx_main(["convert", "torch-dist-to-hf", "--load", dist_dir, "--out", hf_out, "--max-shard-gb", "2e-5"]) == 0
    assert os.path.isfile(os.path.join(hf_out, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(hf_out) if f.endswith(".safetensors")]) > 1
    original = _read_hf_folder(hf_in)
    _assert_identical(_read_hf_folder(hf_out), original)
    # ... and the sharded folder converts again (index reading) to the same weights.
    assert stacx_main(["convert", "hf-to-torch-dist", "--hf-checkpoint", hf_out, "--out", dist_again]) == 0
    assert stacx_main(["convert", "torch-dist-to-hf", "--load", dist_again, "--out", hf_again]) == 0
    _assert_identical(_read_hf_folder(hf_again), original)
    reference = AutoModelForCausalLM.from_pretrained(hf_in, dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32).eval()
    tokens = torch.arange(12)[None]
    assert torch.equal(exported(tokens).logits, reference(tokens).logits)


def _convert_error(capsys, *argv) -> str:
    assert stacx_main(["convert", *argv]) == 2
    return capsys.readouterr().err


def test_convert_command_errors_name_the_problem(tmp_path, capsys):
    hf_in = str(tmp_path / "hf")
    save_tiny_hf_checkpoint(hf_in, "llama", seed=0)  # 4 heads, 2 KV heads
    out = str(tmp_path / "out")
    message = _convert_error(capsys, "hf-to-torch-dist", "--hf-checkpoint", str(tmp_path / "nowhere"), "--out", out)
    assert "folder not found" in message and "nowhere" in message
    message = _convert_error(capsys, "hf-to-torch-dist", "--hf-checkpoint", hf_in, "--tensor-model-parallel-size", "4",
                             "--out", out)
    assert "num_key_value_heads=2" in message and "4" in message
    message = _convert_error(capsys, "torch-dist-to-hf", "--load", str(tmp_path / "missing"), "--out", out)
    assert "missing" in message and "folder not found" in message
    message = _convert_error(capsys, "torch-dist-to-hf", "--load", hf_in, "--out", out)
    assert "neither" not in message and "Hugging Face folder, not torch_dist" in message

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    message = _convert_error(capsys, "hf-to-torch-dist", "--hf-checkpoint", str(gpt2), "--out", out)
    assert "'gpt2'" in message and "['llama', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe']" in message


@pytest.mark.parametrize(
    "edit, named",
    [
        ("shape", "model.layers.1.mlp.down_proj.weight"),
        ("missing", "model.layers.0.self_attn.k_proj.weight"),
        ("extra", "model.layers.2.input_layernorm.weight"),
    ],
)
def test_mismatched_checkpoint_fails_naming_the_tensor(tmp_path, edit, named):
    from stacx.checkpointing.convert import convert_hf_to_torch_dist
    from stacx.models.checkpoint import CheckpointMismatchError

    folder = str(tmp_path / "hf")
    save_tiny_hf_checkpoint(folder, "llama", seed=0)
    file = os.path.join(folder, "model.safetensors")
    tensors = load_file(file)
    if edit == "shape":
        tensors[named] = tensors[named][:, :-1].contiguous()
    elif edit == "missing":
        del tensors[named]
    else:
        tensors[named] = torch.ones(64)
    save_file(tensors, file)
    with pytest.raises(CheckpointMismatchError, match=named.replace(".", r"\.")):
        convert_hf_to_torch_dist(folder, str(tmp_path / "out"), 1)


def export_buckets_and_torch_dist(groups, hf_dir, out_dir, dist_dir, bad_dir):
    from stacx.models import (
        CheckpointMismatchError,
        build_model,
        export_hf_checkpoint,
        iter_hf_weight_buckets,
        load_hf_checkpoint,
    )
    from stacx.checkpointing.torch_dist import load_torch_dist, save_torch_dist

    model = build_model(hf_dir, groups, initialize_weights=False)
    load_hf_checkpoint(model, hf_dir, groups)
    export_hf_checkpoint(model, out_dir, groups, hf_dir)
    buckets = [[(name, t.clone()) for name, t in bucket] for bucket in iter_hf_weight_buckets(model, groups, 20_000)]
    # What a weight push streams (RoleRuntime.weight_buckets): only TP rank 0 receives the gathered tensors.
    pushed = [[(name, t.clone()) for name, t in bucket]
              for bucket in iter_hf_weight_buckets(model, groups, 20_000, only_to_tp_rank=0)]
    save_torch_dist(dist_dir, model, groups=groups)
    reloaded = build_model(hf_dir, groups)
    load_torch_dist(dist_dir, reloaded)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reloaded.parameters()))
    try:
        load_hf_checkpoint(build_model(hf_dir, groups), bad_dir, groups)
        error = None
    except CheckpointMismatchError as err:
        error = str(err)
    return buckets, pushed, same, error


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_export_is_byte_identical_and_buckets_stream_every_tensor(tmp_path):
    hf_dir, out_dir, dist_dir, bad_dir = (str(tmp_path / n) for n in ("hf", "export", "dist", "bad"))
    save_tiny_hf_checkpoint(hf_dir, "qwen3", seed=5, tie_word_embeddings=True)
    save_tiny_hf_checkpoint(bad_dir, "qwen3", seed=5, tie_word_embeddings=True, intermediate_size=64)
    results = run_distributed(export_buckets_and_torch_dist, 2, tensor_model_parallel_size=2,
                              args=(hf_dir, out_dir, dist_dir, bad_dir))
    original = _read_hf_folder(hf_dir)
    _assert_identical(_read_hf_folder(out_dir), original)
    assert "lm_head.weight" not in original  # tied: nothing extra is written either

    (buckets_0, pushed_0, same_0, error_0), (buckets_1, pushed_1, _, _) = results
    streamed = [pair for bucket in buckets_0 for pair in bucket]
    _assert_identical(dict(streamed), original)
    assert len(streamed) == len(original)  # each tensor exactly once
    assert [name for name, _ in streamed] == [name for b in buckets_1 for name, _ in b]  # same order on every TP rank
    for bucket in buckets_0:
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        assert len(bucket) == 1 or nbytes <= 20_000
    assert len(buckets_0) > 3
    # A TP=2 push: TP rank 0 sends the same buckets, tensor for tensor; TP rank 1 only took part in the gathers.
    assert [[name for name, _ in b] for b in pushed_0] == [[name for name, _ in b] for b in buckets_0]
    assert all(torch.equal(a, b) for pa, ba in zip(pushed_0, buckets_0) for (_, a), (_, b) in zip(pa, ba))
    assert pushed_1 == []

    assert same_0  # a live tp=2 model's torch_dist save loads back bitwise
    assert error_0 is not None and "model.layers.0.mlp.gate_proj.weight" in error_0 and "[64, 64]" in error_0


@pytest.mark.parametrize(
    "arch, overrides, message",
    [
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
    ],
)
def test_unsupported_config_features_are_rejected_by_name(arch, overrides, message):
    with pytest.raises(ValueError, match=message):
        decoder_shape(tiny_hf_config(arch, **overrides))
