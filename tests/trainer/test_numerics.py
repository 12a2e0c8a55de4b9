"""NaN/inf stop the run before non-finite weights exist: the optimizer never steps on them (on every
rank alike), the driver names step, role and metric, and --skip-nonfinite-steps skips a bounded number."""

from __future__ import annotations

import math
import os

import pytest
import torch

from stacx.trainer.numerics import (NonFiniteError, NonFiniteGuard, first_nonfinite_metric, first_nonfinite_sample,
                                    step_optimizer_if_finite)

NAN, INF = float("nan"), float("inf")


# ---- units ---------------------------------------------------------------------------------------

def test_the_first_offending_metric_is_the_loss_then_the_grad_norm_then_in_order():
    assert first_nonfinite_metric({"kl": NAN, "grad_norm": INF, "loss": NAN}) == "loss"
    assert first_nonfinite_metric({"kl": NAN, "grad_norm": INF, "loss": 1.0}) == "grad_norm"
    assert first_nonfinite_metric({"kl": 0.1, "entropy": -INF, "loss": 1.0, "note": "text"}) == "entropy"
    assert first_nonfinite_metric({"loss": 1.0, "grad_norm": 2.0}) is None


def test_the_first_offending_sample_of_floats_and_tensors():
    assert first_nonfinite_sample([1.0, NAN, INF]) == (1, pytest.approx(NAN, nan_ok=True))
    assert first_nonfinite_sample([torch.zeros(3), torch.tensor([0.0, INF])]) == (1, INF)
    assert first_nonfinite_sample([torch.zeros(0), 2.0]) is None


def test_the_guard_raises_naming_step_role_metric_unless_skips_remain():
    with pytest.raises(NonFiniteError, match=r"step 4: role 'policy' produced a non-finite loss \(nan\).*"
                                             r"--skip-nonfinite-steps"):
        NonFiniteGuard(0).check_metrics(step=4, role="policy", metrics={"loss": NAN, "grad_norm": 1.0})
    guard = NonFiniteGuard(2)
    assert guard.check_samples(step=1, role="policy", name="reward", values=[0.0, NAN])
    assert guard.check_metrics(step=1, role="critic", metrics={"loss": INF})  # same step: counted once
    assert guard.check_metrics(step=3, role="policy", metrics={"loss": 1.0, "grad_norm": NAN})
    assert not guard.check_metrics(step=4, role="policy", metrics={"loss": 1.0, "grad_norm": 1.0})
    with pytest.raises(NonFiniteError, match=r"step 5: role 'policy' produced a non-finite advantage of sample 0"
                                             r".*already skipped 2 step\(s\): \[1, 3\]"):
        guard.check_samples(step=5, role="policy", name="advantage", values=[torch.tensor([NAN])])
    with pytest.raises(NonFiniteError, match="non-finite weights after its optimizer update"):
        NonFiniteGuard(9).check_metrics(step=0, role="policy", metrics={"loss": 1.0, "weights_nonfinite": 1.0})
    with pytest.raises(ValueError, match="--skip-nonfinite-steps must be >= 0"):
        NonFiniteGuard(-1)


class FakeMegatronOptimizer:
    """The four calls of megatron's optimizer that step_optimizer_if_finite uses, on one parameter."""

    def __init__(self, grad: float, lr: float = 0.1):
        self.param = torch.nn.Parameter(torch.ones(2))
        self.param.grad = torch.full((2,), grad)
        self.lr, self.calls = lr, []

    def prepare_grads(self):
        self.calls.append("prepare_grads")
        return False

    def get_grad_stats_parallel_group(self):
        return None  # the default (world) group, where the test's process has one

    def get_grad_norm(self):
        return float(self.param.grad.norm())

    def step(self):
        self.calls.append("step")
        with torch.no_grad():
            self.param -= self.lr * self.param.grad
        return True, self.get_grad_norm(), None

    def zero_grad(self):
        self.calls.append("zero_grad")
        self.param.grad = None

    def get_parameters(self):
        return [self.param]


def test_a_non_finite_gradient_or_loss_is_never_stepped_on():
    for grad, loss in ((NAN, 1.0), (INF, 1.0), (1.0, NAN)):
        optimizer = FakeMegatronOptimizer(grad)
        outcome = step_optimizer_if_finite(optimizer, loss)
        assert not outcome.applied and "step" not in optimizer.calls and "zero_grad" in optimizer.calls
        assert torch.equal(optimizer.param.detach(), torch.ones(2)) and outcome.weights_finite
    optimizer = FakeMegatronOptimizer(1.0)
    outcome = step_optimizer_if_finite(optimizer, 0.5)
    assert outcome.applied and outcome.grad_norm == pytest.approx(math.sqrt(2)) and outcome.weights_finite
    assert optimizer.param.detach().tolist() == pytest.approx([0.9, 0.9])
    overflow = FakeMegatronOptimizer(1.0, lr=INF)  # a finite gradient, an update that overflows the weights
    assert not step_optimizer_if_finite(overflow, 0.5).weights_finite


def _driver_trainer(rewards, *, skip: int):
    """An SFT StacxTrainer over a fake role group whose dataset's step batch carries `rewards` (no workers)."""
    from stacx.trainer.batch import StepBatch
    from stacx.trainer.config.run import RunConfig
    from tests.trainer.fakes import FakeDataSource, make_trainer

    batch = StepBatch.supervised([[1, 2]] * len(rewards), [[3, 4]] * len(rewards))
    batch.rewards = list(rewards)
    return make_trainer("sft", data=FakeDataSource(batch), run_config=RunConfig.from_dict({"skip_nonfinite_steps": skip}))


def test_a_nan_reward_stops_the_step_before_any_role_trains():
    trainer = _driver_trainer([1.0, NAN], skip=0)
    with pytest.raises(NonFiniteError, match=r"step 7: role 'policy' produced a non-finite reward of sample 1"):
        trainer.train_one_step(7)
    assert trainer.roles["policy"].calls == []
    trainer = _driver_trainer([1.0, NAN], skip=1)
    metrics = trainer.train_one_step(7)
    assert trainer.roles["policy"].calls == [] and metrics["train/nonfinite_skipped_steps"] == 1.0
    trainer = _driver_trainer([1.0, 0.5], skip=0)
    trainer.train_one_step(7)
    assert trainer.roles["policy"].calls == ["train_step"]  # finite rewards: the role trains


# ---- end to end: two gloo ranks of an SFT run (the skip must be the same on both) -----------------

def sft_run(groups, root: str, name: str, values: dict):
    """Run the SFT recipe on this rank; returns (error text or None, last metrics)."""
    from stacx.trainer.spmd import run_spmd
    from tests.trainer.training_fixtures import run_config

    config = run_config(root, train={"algorithm": "sft"}, hf_checkpoint=os.path.join(root, "policy"),
                        prompt_data=os.path.join(root, "sft.jsonl"), rollout_batch_size=4,
                        out=os.path.join(root, name, "out"), save=os.path.join(root, name, "ckpt"), save_interval=1,
                        export_hf=os.path.join(root, name, "export"), **values)
    try:
        return None, run_spmd(config)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}", None


def _model_tensors(model_folder: str) -> list[torch.Tensor]:
    """The floating-point tensors of a step's torch_dist model folder (weights and optimizer state), by key."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(model_folder, path)
        state = torch.load(path, weights_only=True)
    return [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor) and state[k].is_floating_point()]


def _saved_tensors(checkpoint_root: str) -> list[torch.Tensor]:
    from glob import glob

    return [t for folder in sorted(glob(os.path.join(checkpoint_root, "step_*", "roles", "*", "model")))
            for t in _model_tensors(folder)]


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory):
    from tests.trainer.training_fixtures import write_tiny_run_files

    root = str(tmp_path_factory.mktemp("numerics"))
    write_tiny_run_files(root)
    return root


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_diverging_run_stops_naming_step_role_and_metric_and_leaves_no_nonfinite_weights(sft_files):
    from stacx.testing.distributed import run_distributed

    # lr 1e30: step 0's Adam update makes the weights ~1e30 (finite); step 1's forward is NaN.
    results = run_distributed(sft_run, 2, args=(sft_files, "diverged", {"lr": 1e30, "num_steps": 3}), timeout_s=300)
    for error, _ in results:
        assert error is not None and error.startswith("NonFiniteError: step 1: role 'policy' produced a non-finite")
        assert "loss" in error or "grad_norm" in error
    run = os.path.join(sft_files, "diverged")
    assert not os.path.exists(os.path.join(run, "export"))  # never exported
    assert sorted(os.listdir(os.path.join(run, "ckpt"))) == ["step_000000001"]  # the last finite step only
    saved = _saved_tensors(os.path.join(run, "ckpt"))
    assert saved and all(bool(torch.isfinite(t).all()) for t in saved)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_skipped_steps_apply_no_update_on_any_rank_and_the_run_finishes(sft_files):
    from stacx.testing.distributed import run_distributed
    from tests.trainer.training_fixtures import read_metrics

    results = run_distributed(sft_run, 2, args=(sft_files, "skipped", {"lr": 1e30, "num_steps": 3,
                                                                        "skip_nonfinite_steps": 2}), timeout_s=300)
    assert [error for error, _ in results] == [None, None]
    assert [last["policy/update_skipped"] for _, last in results] == [1.0, 1.0]  # both ranks skipped alike
    rows = read_metrics(os.path.join(sft_files, "skipped", "out"))
    assert [row["train/nonfinite_skipped_steps"] for row in rows] == [0.0, 1.0, 2.0]
    ckpt = os.path.join(sft_files, "skipped", "ckpt")
    after_1 = _saved_tensors_of(ckpt, 1)
    after_3 = _saved_tensors_of(ckpt, 3)
    assert all(torch.equal(a, b) for a, b in zip(after_1, after_3))  # the skipped steps changed nothing
    assert all(bool(torch.isfinite(t).all()) for t in after_3)
    assert os.path.isfile(os.path.join(sft_files, "skipped", "export", "config.json"))


def _saved_tensors_of(checkpoint_root: str, step: int) -> list[torch.Tensor]:
    from glob import glob

    tensors = [t for folder in sorted(glob(os.path.join(checkpoint_root, f"step_{step:09d}", "roles", "*", "model")))
               for t in _model_tensors(folder)]
    assert tensors, f"no model tensors in step {step} of {checkpoint_root}"
    return tensors
