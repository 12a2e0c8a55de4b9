"""Context parallelism end to end: GRPO on a local Ray cluster with the policy at TP=2 x CP=2 trains
2 steps, and the first step's loss, gradient norm and KL/entropy metrics equal the CP=1, TP=1 run's
(same seed, same data: a fresh engine from the same checkpoint samples the same step-0 rollouts).
The split-invariance promise of docs/parallel.md, through the whole loop. (CP=2 alone, and every
other split, is checked against the single-process reference on spawned gloo ranks in
tests/specializations/test_split_invariance.py; one loop run at the largest layout covers the wiring.)

Tolerance: fp32 runs whose reductions differ only in order (CP splits each sequence into
2*cp chunks, TP splits the vocabulary and hidden sums): relative 1e-5, absolute 1e-6
(measured differences are about 2e-7 relative).
"""

from __future__ import annotations

import math

import pytest

from tests.trainer.training_fixtures import ATTACHED_SERVER_KEY, VARIED_REWARD, read_metrics, run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

RELATIVE, ABSOLUTE = 1e-5, 1e-6
COMPARED = ("policy/loss", "policy/grad_norm", "policy/kl_loss", "policy/entropy", "policy/pg_loss")


def _train(files, root, *, tp: int, cp: int, num_steps: int) -> list[dict]:
    """GRPO from the initial checkpoint with a fresh engine. The in-worker reference is a different model
    (the teacher checkpoint) and the entropy bonus is on, so step 0's loss is not the trivial 0 of
    group-centered advantages at ratio 1: it checks reference log-probs and entropy under CP too."""
    from stacx.serving.cpu_engine import CpuEngine
    from stacx.serving.server import EngineHttpServer
    from stacx.trainer.factory import create_trainer

    server = EngineHttpServer(CpuEngine.from_hf_checkpoint(files["policy"], seed=0), api_key=ATTACHED_SERVER_KEY).start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("STACX_API_KEY", ATTACHED_SERVER_KEY)  # the driver's key for the attached server
            cfg = run_config(str(root), train={"algorithm": "grpo"}, algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1,
                                                   "entropy_coef": 0.01},
                             hf_checkpoint=files["policy"], ref_load=files["teacher"], prompt_data=files["prompts"],
                             rollout_engine="http", rollout_urls=[server.url], reward_fn=VARIED_REWARD,
                             tensor_model_parallel_size=tp, context_parallel_size=cp, num_steps=num_steps)
            trainer = create_trainer(cfg)
            layout = trainer.roles["policy"].layout
            assert (layout.tensor_model_parallel_size, layout.context_parallel_size) == (tp, cp)
            trainer.run()
    finally:
        server.stop()
    return read_metrics(str(root / "out"))


@pytest.fixture(scope="module")
def baseline(files, ray_address, single_process_world, tmp_path_factory):
    """The CP=1, TP=1 run's first step."""
    return _train(files, tmp_path_factory.mktemp("cp1"), tp=1, cp=1, num_steps=1)[0]


def _assert_first_step_matches(rows: list[dict], baseline: dict) -> None:
    assert [row["step"] for row in rows] == [0, 1]
    first = rows[0]
    # Same rollouts: the engine served the same initial weights with the same seed.
    assert first["rollout/reward_mean"] == baseline["rollout/reward_mean"]
    assert first["rollout/response_length_mean"] == baseline["rollout/response_length_mean"]
    compared = [name for name in COMPARED if name in baseline]
    assert {"policy/loss", "policy/grad_norm"} <= set(compared), sorted(baseline)
    assert baseline["policy/grad_norm"] > 0 and baseline["policy/kl_loss"] > 1e-3 and abs(baseline["policy/loss"]) > 1e-3
    for name in compared:
        assert first[name] == pytest.approx(baseline[name], rel=RELATIVE, abs=ABSOLUTE), name
    # The second step trained on rollouts of the weights pushed after step 0.
    assert rows[1]["rollout/weight_version"] == 1.0
    assert math.isfinite(rows[1]["policy/loss"]) and rows[1]["policy/grad_norm"] > 0


def test_tp2_cp2_first_step_equals_cp1(files, ray_address, single_process_world, baseline, tmp_path):
    _assert_first_step_matches(_train(files, tmp_path, tp=2, cp=2, num_steps=2), baseline)
