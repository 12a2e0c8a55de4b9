"""Pipeline parallelism on spawned gloo ranks against one process.

- The real training loop (GRPO, 2 rollouts x 2 optimizer steps, old log-probs computed through the
  schedule) with PP=2 x DP=2 on a tied-embedding 4-layer model gives the PP=1 run's first step to
  1e-6 relative (fp32 rounding: the grad norm adds its squares stage by stage) and the later steps,
  after AdamW updates, to 1e-5. The same holds with two virtual stages per pipeline rank (megatron's
  interleaved schedule).
- PP=2 x TP=2: forward-only log-probs through the schedule equal transformers' (1e-5);
  weights stream to the first stage in Hugging Face names, equal to the checkpoint bit for bit
  (the tied LM head is sent once); the torch_dist checkpoint written there loads at PP=1 exactly.
- A mixture-of-experts RoleRuntime step at PP=2 x EP=2 equals the PP=1 step (router losses on).
- Checkpoints reshard across PP with the optimizer state: the PP=1 run's last checkpoint loaded at
  PP=2 x TP=2 and saved, then loaded back at PP=1 and saved, holds the same tensors bit for bit
  (weights and Adam moments).
- Unit level: the micro-batch plan fills the pipeline (a multiple of P for the interleaved schedule), and
  the preflight names the flags.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch


from tests.models.test_moe import save_moe_checkpoint


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


SEQUENCES = ([5, 9, 2, 7, 7, 3, 1], [4, 4, 8, 1, 6], [2, 3, 5, 7, 11, 13, 17, 19, 23])
RESPONSE_LENGTHS = (4, 2, 6)


def _with_optimizer(model):
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.runtime.optim import build_optimizer, wrap_ddp

    from tests.trainer.mini_batch_reference import SETTINGS

    optimizer, _ = build_optimizer(wrap_ddp(model), RunConfig.from_dict(SETTINGS).optim, total_steps=1)
    return optimizer


def reshard(model, source: str, target: str, groups) -> None:
    """Load torch_dist `source` (weights and optimizer state) into `model` at this layout, save it to `target`."""
    from stacx.checkpointing.torch_dist import load_torch_dist, save_torch_dist

    optimizer = _with_optimizer(model)
    assert load_torch_dist(source, model, optimizer)
    save_torch_dist(target, model, optimizer, groups=groups)


def stream_and_save_stages(groups, checkpoint: str, folder: str, trained: str, resharded: str):
    """Load the HF checkpoint into this rank's stage and TP/CP shard; forward-only log-probs through the
    schedule; stream every stage's weights to the first; save torch_dist. Then load the PP=1 run's trained
    checkpoint (`trained`, with its optimizer state) at this layout and save it again (`resharded`)."""
    from stacx.checkpointing.torch_dist import save_torch_dist
    from stacx.models import build_model, forward_packed
    from stacx.models.checkpoint import iter_hf_weight_buckets, load_hf_checkpoint
    from stacx.objectives.algorithm_config import AlgorithmConfig
    from stacx.parallel.pipeline import run_pipeline
    from stacx.specializations.batch import MicroBatch
    from stacx.trainer.recipes import get_recipe

    model = build_model(checkpoint, groups, initialize_weights=False)
    load_hf_checkpoint(model, checkpoint, groups)
    specialization = get_recipe("sft").roles[0].specialization_cls(AlgorithmConfig(), groups)
    def packed(indices):
        return MicroBatch.pack([torch.tensor(SEQUENCES[i]) for i in indices], [RESPONSE_LENGTHS[i] for i in indices],
                               groups=groups, loss_masks=[torch.ones(RESPONSE_LENGTHS[i]) for i in indices])

    batches = [packed([0, 1]), packed([2])]

    def stage_forward(batch, chunk):
        return forward_packed(chunk, *batch.model_inputs(), groups)

    with torch.no_grad():
        log_probs = run_pipeline(model, batches, stage_forward,
                                 lambda output, batch: (output.new_zeros(()), specialization.compute_log_probs(output, batch)),
                                 forward_only=True)
    streamed = [pair for bucket in iter_hf_weight_buckets(model, groups, 1 << 16) for pair in bucket]
    save_torch_dist(folder, model, groups=groups)
    reshard(model, trained, resharded, groups)
    return {"stage": groups.pp_rank, "tp": groups.tp_rank, "cp": groups.cp_rank, "layers": len(model.decoder.layers),
            "log_probs": [lp for per_batch in log_probs for lp in per_batch], "streamed": streamed}


def load_at_one_stage(groups, checkpoint: str, folders: list[str], trained: str, resharded: str, resharded_back: str):
    """Each PP=2 torch_dist folder of `folders` loaded at PP=1, in HF names; the PP=2 copy of the trained
    checkpoint loaded at PP=1 and saved again; {key: (trained, at PP=2, back at PP=1)} of every tensor of the three."""
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    from stacx.checkpointing.torch_dist import load_torch_dist
    from stacx.models import build_model
    from stacx.models.checkpoint import iter_hf_weight_buckets

    streamed = []
    for folder in folders:
        model = build_model(checkpoint, groups)  # random weights: the load must replace every one
        load_torch_dist(folder, model)
        streamed.append([pair for bucket in iter_hf_weight_buckets(model, groups, 1 << 16) for pair in bucket])
    reshard(build_model(checkpoint, groups), resharded, resharded_back, groups)
    states = [load_plain_tensors(path) for path in (trained, resharded, resharded_back)]
    return streamed, {key: tuple(state[key] for state in states) for key in states[0]}


def train_then_interleave(groups, root: str, checkpoint: str, rollouts, values: dict, folder: str,
                          moe_checkpoint: str) -> dict:
    """The GRPO loop at this layout; then a role with two model chunks per pipeline rank (one layer per virtual
    stage: chunk c of rank r holds layer 2c + r), its log-probs through megatron's interleaved schedule, its
    weights streamed to the first stage and saved as torch_dist (`folder`). Before that, the GRPO loop again
    with those chunks (interleaved schedule)."""
    from stacx.checkpointing.torch_dist import save_torch_dist
    from stacx.objectives.algorithm_config import AlgorithmConfig
    from stacx.specializations.actor import ActorSpecialization
    from stacx.trainer.batch import StepBatch
    from stacx.trainer.config.recipe import ModelRole
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.runtime.role_runtime import RoleRuntime
    from tests.trainer import mini_batch_reference as reference

    result = reference.train_stacx(groups, root, checkpoint, rollouts, values)
    # The same GRPO run with two model chunks per pipeline rank (one layer per virtual stage): megatron's
    # interleaved schedule, over gloo through the tagged exchanges of megatron_cpu_compat (patch 9).
    result["interleaved_rows"] = reference.train_stacx(groups, root + "_interleaved", checkpoint, rollouts,
                                                       {**values, "num_layers_per_virtual_pipeline_stage": 1})["rows"]
    run_config = RunConfig.from_dict({"hf_checkpoint": checkpoint, "num_layers_per_virtual_pipeline_stage": 1})
    sections = dict(model=run_config.model, optim=run_config.optim, train=run_config.train)
    algorithm = AlgorithmConfig.from_values({"advantage_estimator": "grpo"})
    runtime = RoleRuntime(ModelRole(name="reference", specialization_cls=ActorSpecialization, trainable=False),
                          algorithm, groups, **sections)
    def step_batch(indices):
        return StepBatch(tokens=[torch.tensor(SEQUENCES[i]) for i in indices],
                         response_lengths=[RESPONSE_LENGTHS[i] for i in indices],
                         loss_masks=[torch.ones(RESPONSE_LENGTHS[i]) for i in indices])

    fields = runtime.compute_fields([step_batch([0, 1]), step_batch([2])], ["log_probs"])
    result["chunk_layers"] = [len(chunk.decoder.layers) for chunk in runtime.model]
    result["log_probs"] = None if fields is None else [lp for per_batch in fields for lp in per_batch["log_probs"]]
    result["streamed"] = [pair for bucket in runtime.weight_buckets(1 << 16) for pair in bucket]
    save_torch_dist(folder, runtime.model, groups=groups)
    # A mixture-of-experts step at PP=2 x EP=2 (each stage's two DP ranks hold 2 of the 4 experts each) and at
    # PP=1 x EP=1 (DP=4), every rank holding the same micro-batches, router losses on.
    from tests.models.test_moe_training import _runtime_step

    result["moe"] = {layout: _runtime_step(moe_checkpoint, ep, pp=pp)[:2] for layout, ep, pp in (("pp1", 1, 1),
                                                                                                  ("pp2_ep2", 2, 2))}
    return result


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pp2_dp2_grpo_steps_equal_the_pp1_run_and_weights_reshard(tmp_path):
    from transformers import AutoModelForCausalLM

    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.testing.distributed import run_distributed
    from tests.trainer import mini_batch_reference as reference

    root = str(tmp_path)
    checkpoint = _write_tied_checkpoint(root)
    rollouts = reference.make_rollouts(2, len(build_char_tokenizer()))
    values = {"num_steps_per_rollout": 2, "max_tokens_per_micro_batch": 40}
    saving = {**values, "save": os.path.join(root, "saved_pp1")}  # the PP=1 run keeps its last step
    single = run_distributed(reference.train_stacx, 1, args=(os.path.join(root, "pp1"), checkpoint, rollouts, saving))
    interleaved_folder = os.path.join(root, "torch_dist_interleaved")
    moe_checkpoint = os.path.join(root, "moe")
    save_moe_checkpoint("qwen3_moe", moe_checkpoint)
    piped = run_distributed(train_then_interleave, 4, pipeline_model_parallel_size=2,
                            args=(os.path.join(root, "pp2"), checkpoint, rollouts, values, interleaved_folder,
                                  moe_checkpoint))
    rows = single[0]["rows"]
    assert all(result["calls"] == [["log_probs"]] * 2 for result in piped)
    # PP=2, and PP=2 with two virtual stages per rank (interleaved schedule), train what PP=1 trains.
    for piped_rows in (piped[0]["rows"], piped[0]["interleaved_rows"]):
        assert len(rows) == len(piped_rows) == 4
        for index, (row, piped_row) in enumerate(zip(rows, piped_rows)):
            # The first step starts from the same weights: fp32 rounding. Later steps follow AdamW updates of
            # gradients summed in another order (over stages and DP ranks): 1e-5, as the DP=2 peer check.
            rel = 1e-6 if index == 0 else 1e-5
            for name in ("policy/loss", "policy/pg_loss", "policy/entropy", "policy/grad_norm"):
                assert piped_row[name] == pytest.approx(row[name], rel=rel, abs=1e-7), (index, name)
            assert piped_row["policy/pg_clipfrac"] == row["policy/pg_clipfrac"]
        assert piped_rows[1]["policy/pg_clipfrac"] > 0  # the second mini-batch of a rollout clips: real updates

    # PP=2 x TP=2: forward-only log-probs from the last stage equal transformers'; every stage's
    # tensors reach the first stage in HF names, bit for bit; a torch_dist checkpoint loads at PP=1.
    # (4 ranks: CP=2 as well made it 8 on two cores; CP is checked with TP=2 in
    # tests/checkpointing/test_reshard_and_resume.py and against one process in tests/specializations.)
    folder = os.path.join(root, "torch_dist_pp2")
    [trained] = glob.glob(os.path.join(root, "saved_pp1", "step_*", "roles", "policy", "model"))
    resharded, resharded_back = os.path.join(root, "resharded_pp2"), os.path.join(root, "resharded_pp1")
    ranks = run_distributed(stream_and_save_stages, 4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                            args=(checkpoint, folder, trained, resharded))
    assert all(r["layers"] == 2 for r in ranks)
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def assert_hf_log_probs(all_log_probs):
        for sequence, response_length, log_probs in zip(SEQUENCES, RESPONSE_LENGTHS, all_log_probs, strict=True):
            ids = torch.tensor([sequence])
            with torch.no_grad():
                logits = hf_model(input_ids=ids).logits[0].float()
            expected_log_probs = torch.log_softmax(logits[-response_length - 1:-1], -1).gather(
                -1, ids[0, -response_length:, None])[:, 0]
            torch.testing.assert_close(log_probs, expected_log_probs, rtol=1e-5, atol=1e-5)

    for r in ranks:
        if r["stage"] == 0:
            assert r["log_probs"] == []
            continue
        assert_hf_log_probs(r["log_probs"])
    first_stage = next(r for r in ranks if r["stage"] == 0 and r["tp"] == 0 and r["cp"] == 0)
    assert all(r["streamed"] == [] for r in ranks if r["stage"] == 1)  # the last stage sent its tensors to the first
    expected = _hf_tensors(checkpoint)
    streamed = dict(first_stage["streamed"])
    assert len(streamed) == len(first_stage["streamed"])  # the tied head is sent once, as the embedding
    assert set(streamed) == set(expected)
    assert all(torch.equal(streamed[name], expected[name]) for name in expected)
    # MoE at PP=2 x EP=2 equals PP=1: the loss to 1e-6, every gradient to 1e-5 of its largest entry (streamed to
    # the first stage in HF names), the expert load of both stages.
    (metrics, grads), (piped_metrics, piped_grads) = piped[0]["moe"]["pp1"], piped[0]["moe"]["pp2_ep2"]
    assert piped_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-6)
    assert set(piped_grads) == set(grads) and len(grads) > 0
    for name, grad in grads.items():
        assert (piped_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), f"pp=2 x ep=2 grad {name}"
    # the same batch on 4 DP ranks at PP=1, on 2 at PP=2: half the token slots, the same imbalance
    assert {k: v for k, v in piped_metrics.items() if k.startswith("moe/")} == pytest.approx(
        {k: v / 2 if k.endswith("_tokens") else v for k, v in metrics.items() if k.startswith("moe/")})

    # Two model chunks per rank (interleaved schedule, forward only): the last stage's log-probs equal
    # transformers'; every chunk's tensors reach the first stage bit for bit.
    assert all(r["chunk_layers"] == [1, 1] for r in piped)
    assert sum(r["log_probs"] is not None for r in piped) == 2  # the last stage's two DP ranks
    for r in piped:
        if r["log_probs"] is not None:
            assert_hf_log_probs(r["log_probs"])
    first_stages = [dict(r["streamed"]) for r in piped if r["streamed"]]
    assert len(first_stages) == 2
    assert all(set(s) == set(expected) and all(torch.equal(s[n], expected[n]) for n in expected) for s in first_stages)

    # The torch_dist folders written at PP=2 (one chunk per rank, and two) load at PP=1 exactly.
    streamed_at_pp1, states = run_distributed(
        load_at_one_stage, 1, args=(checkpoint, [folder, interleaved_folder], trained, resharded, resharded_back))[0]
    for streamed_folder in streamed_at_pp1:
        loaded = dict(streamed_folder)
        assert set(loaded) == set(expected)
        assert all(torch.equal(loaded[name], expected[name]) for name in expected)

    # The PP=1 run's last checkpoint, weights and Adam moments, loaded at PP=2 x TP=2 and saved, then
    # loaded back at PP=1 and saved: every tensor of the three folders is the same, bit for bit.
    moments = [key for key in states if key.startswith("optimizer.state.exp_avg")]
    assert len(moments) == 2 * len([key for key in states if not key.startswith("optimizer")])
    assert all(states[key][0].abs().max() > 0 for key in moments)  # a trained state, not a fresh optimizer
    for key, (saved, at_pp2, back_at_pp1) in states.items():
        if torch.is_tensor(saved):
            assert torch.equal(at_pp2, saved) and torch.equal(back_at_pp1, saved), key
    assert states["optimizer"][0]["state"]["common_step"] == states["optimizer"][2]["state"]["common_step"] == 4


def test_the_micro_batch_plan_gives_each_stage_a_full_pipeline():
    from stacx.trainer.batch import plan_micro_batches
    from tests.trainer.mini_batch_reference import make_rollouts, step_batch

    batch = step_batch(make_rollouts(1, 50)[0])  # 16 samples of at most 14 tokens
    roomy = dict(dp_size=2, cp_size=1, max_tokens_per_micro_batch=1000)
    assert [len(rank) for rank in plan_micro_batches(batch, **roomy)] == [1, 1]
    assert [len(rank) for rank in plan_micro_batches(batch, **roomy, pp_size=4)] == [4, 4]
    # Never more micro-batches than a rank has samples.
    assert [len(rank) for rank in plan_micro_batches(batch, **roomy, pp_size=64)] == [8, 8]
    # The interleaved schedule runs micro-batches in groups of P: a multiple of P, also when the token budget
    # alone asks for another count (5 here: 8 samples of 7 to 14 tokens per rank, at most 20 tokens each).
    tight = dict(dp_size=2, cp_size=1, max_tokens_per_micro_batch=20)
    assert [len(rank) for rank in plan_micro_batches(batch, **tight, pp_size=2)] == [5, 5]
    assert [len(rank) for rank in plan_micro_batches(batch, **tight, pp_size=2, interleaved=True)] == [6, 6]
    with pytest.raises(ValueError, match=r"needs at least --pipeline-model-parallel-size 16 per rank"):
        plan_micro_batches(batch, **roomy, pp_size=16, interleaved=True)


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
    # Virtual stages split each stage's 2 layers again; they need a pipeline.
    for settings, message in (({"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 3},
                               r"--num-layers-per-virtual-pipeline-stage 3 does not divide the 2 layers .*\[1, 2\]"),
                              ({"num_layers_per_virtual_pipeline_stage": 1},
                               r"--num-layers-per-virtual-pipeline-stage 1 needs --pipeline-model-parallel-size > 1")):
        with pytest.raises(PreflightError, match=message):
            check_parallel_layout(RunConfig.from_dict({"hf_checkpoint": str(tmp_path), **settings}, source="test"))
    check_parallel_layout(RunConfig.from_dict({"hf_checkpoint": str(tmp_path), "pipeline_model_parallel_size": 2,
                                               "num_layers_per_virtual_pipeline_stage": 1}, source="test"))
