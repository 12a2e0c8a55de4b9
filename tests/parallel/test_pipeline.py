"""Pipeline parallelism on spawned gloo ranks against one process.

- The real training loop (GRPO, 2 rollouts x 2 optimizer steps, old log-probs computed through the
  schedule) with PP=2 x DP=2 on a tied-embedding 4-layer model gives the PP=1 run's first step to
  1e-6 relative (fp32 rounding: the grad norm adds its squares stage by stage) and the later steps,
  after AdamW updates, to 1e-5.
- Weights stream to the first stage in Hugging Face names, equal to the checkpoint bit for bit
  (the tied LM head is sent once); a torch_dist checkpoint written at PP=2 loads at PP=1 exactly.
- Unit level: the micro-batch plan fills the pipeline, and the preflight names the flag.
"""

from __future__ import annotations

import os

import pytest
import torch


def _write_tied_checkpoint(root: str) -> str:
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.rollout.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    path = os.path.join(root, "tied")
    save_tiny_hf_checkpoint(path, "qwen3", seed=3, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                            tie_word_embeddings=True, num_hidden_layers=4)
    tokenizer.save_pretrained(path)
    return path


def _hf_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def stream_and_save_stages(groups, checkpoint: str, folder: str):
    """Load the HF checkpoint into this stage, stream every stage's weights to the first, save torch_dist."""
    from stacx.checkpointing.torch_dist import save_torch_dist
    from stacx.models import build_model
    from stacx.models.checkpoint import iter_hf_weight_buckets, load_hf_checkpoint

    model = build_model(checkpoint, groups, initialize_weights=False)
    load_hf_checkpoint(model, checkpoint, groups)
    streamed = [pair for bucket in iter_hf_weight_buckets(model, groups, 1 << 16) for pair in bucket]
    save_torch_dist(folder, model, groups=groups)
    return {"stage": groups.pp_rank, "layers": len(model.decoder.layers), "streamed": streamed}


def load_at_one_stage(groups, checkpoint: str, folder: str):
    from stacx.checkpointing.torch_dist import load_torch_dist
    from stacx.models import build_model
    from stacx.models.checkpoint import iter_hf_weight_buckets

    model = build_model(checkpoint, groups)  # random weights: the load must replace every one
    load_torch_dist(folder, model)
    return [pair for bucket in iter_hf_weight_buckets(model, groups, 1 << 16) for pair in bucket]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pp2_dp2_grpo_steps_equal_the_pp1_run_and_weights_reshard(tmp_path):
    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.testing.distributed import run_distributed
    from tests.trainer import mini_batch_reference as reference

    root = str(tmp_path)
    checkpoint = _write_tied_checkpoint(root)
    rollouts = reference.make_rollouts(2, len(build_char_tokenizer()))
    values = {"num_steps_per_rollout": 2, "max_tokens_per_micro_batch": 40}
    single = run_distributed(reference.train_stacx, 1, args=(os.path.join(root, "pp1"), checkpoint, rollouts, values))
    piped = run_distributed(reference.train_stacx, 4, pipeline_parallel_size=2,
                            args=(os.path.join(root, "pp2"), checkpoint, rollouts, values))
    rows, piped_rows = single[0]["rows"], piped[0]["rows"]
    assert len(rows) == len(piped_rows) == 4
    assert all(result["calls"] == [["log_probs"]] * 2 for result in piped)
    for index, (row, piped_row) in enumerate(zip(rows, piped_rows)):
        # The first step starts from the same weights: fp32 rounding. Later steps follow AdamW updates of
        # gradients summed in another order (over stages and DP ranks): 1e-5, as the DP=2 peer check.
        rel = 1e-6 if index == 0 else 1e-5
        for name in ("policy/loss", "policy/pg_loss", "policy/entropy", "policy/grad_norm"):
            assert piped_row[name] == pytest.approx(row[name], rel=rel, abs=1e-7), (index, name)
        assert piped_row["policy/pg_clipfrac"] == row["policy/pg_clipfrac"]
    assert piped_rows[1]["policy/pg_clipfrac"] > 0  # the second mini-batch of a rollout clips: real updates

    # Weights: every stage's tensors reach the first stage in HF names, bit for bit; PP=2 -> PP=1 torch_dist.
    folder = os.path.join(root, "torch_dist_pp2")
    stages = run_distributed(stream_and_save_stages, 2, pipeline_parallel_size=2, args=(checkpoint, folder))
    assert [s["layers"] for s in stages] == [2, 2]
    assert stages[1]["streamed"] == []  # the last stage sent its tensors to the first
    expected = _hf_tensors(checkpoint)
    streamed = dict(stages[0]["streamed"])
    assert len(streamed) == len(stages[0]["streamed"])  # the tied head is sent once, as the embedding
    assert set(streamed) == set(expected)
    assert all(torch.equal(streamed[name], expected[name]) for name in expected)
    loaded = dict(run_distributed(load_at_one_stage, 1, args=(checkpoint, folder))[0])
    assert set(loaded) == set(expected)
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)


def test_the_micro_batch_plan_gives_each_stage_a_full_pipeline():
    from stacx.trainer.batch import plan_micro_batches
    from tests.trainer.mini_batch_reference import make_rollouts, step_batch

    batch = step_batch(make_rollouts(1, 50)[0])  # 16 samples of at most 14 tokens
    roomy = dict(dp_size=2, cp_size=1, max_tokens_per_micro_batch=1000)
    assert [len(rank) for rank in plan_micro_batches(batch, **roomy)] == [1, 1]
    assert [len(rank) for rank in plan_micro_batches(batch, **roomy, pp_size=4)] == [4, 4]
    # Never more micro-batches than a rank has samples.
    assert [len(rank) for rank in plan_micro_batches(batch, **roomy, pp_size=64)] == [8, 8]


def test_preflight_names_the_pipeline_flag_when_it_does_not_divide_the_layers(tmp_path):
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.preflight import PreflightError, check_parallel_layout

    save_tiny_hf_checkpoint(tmp_path, "llama", num_hidden_layers=4)
    run_config = RunConfig.from_dict({"hf_checkpoint": str(tmp_path), "pipeline_model_parallel_size": 3}, source="test")
    with pytest.raises(PreflightError, match=r"--pipeline-model-parallel-size 3 does not divide .* num_hidden_layers "
                                             r"4 .*use one of \[1, 2, 4\]"):
        check_parallel_layout(run_config)
    check_parallel_layout(RunConfig.from_dict({"hf_checkpoint": str(tmp_path), "pipeline_model_parallel_size": 2},
                                              source="test"))
