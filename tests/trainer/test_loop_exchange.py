"""An exchange sync driven by the training loop: `grpo_reference_refresh` on a local Ray cluster.

The policy trains at TP=2; the frozen `reference` role (colocated, TP=1, so DP=2) injects the
reference log-probs and is overwritten by the policy's weights every 2 steps. Checked:
- step 0's KL to the reference is ~0 (the reference starts as the initial policy);
- step 1's KL is clearly positive (the policy moved and the reference was NOT refreshed after step 0);
- the exchange ran once, after step 1, moving every Hugging Face tensor;
- after the run, both reference ranks hold weights bitwise-identical to the policy's (gathered
  over TP on the live workers), and those differ from the initial checkpoint.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.trainer.training_fixtures import VARIED_REWARD, read_metrics, run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

def _hf_weights_per_rank(role_group) -> list[dict[str, torch.Tensor]]:
    """Every rank's gathered full Hugging Face tensors ({} on ranks that only join the TP gathers)."""
    from stacx.trainer.cluster.ray.group import produce_on_worker
    from stacx.trainer.runtime.exchange_payloads import WEIGHTS_KEY

    results = role_group.workers.execute_all(functools.partial(produce_on_worker, keys=(WEIGHTS_KEY,)))
    return [{name.split("/", 1)[1]: t for name, t in result.items()} for result in results]


def test_reference_role_is_refreshed_from_the_policy_bitwise(ray_address, files, single_process_world, tmp_path,
                                                             attached_server_key):
    from safetensors.torch import load_file

    from stacx.serving.cpu_engine import CpuEngine
    from stacx.serving.server import EngineHttpServer
    from stacx.trainer.factory import create_trainer

    server = EngineHttpServer(CpuEngine.from_hf_checkpoint(files["policy"], seed=0), api_key=attached_server_key).start()
    try:
        cfg = run_config(str(tmp_path), train={"algorithm": "grpo_reference_refresh"}, algorithm={"kl_loss_coef": 0.1},
                         hf_checkpoint=files["policy"], prompt_data=files["prompts"], rollout_engine="http",
                         rollout_urls=[server.url], tensor_model_parallel_size=2, reward_fn=VARIED_REWARD,
                         exchange_every_n_steps=2)
        trainer = create_trainer(cfg)
        layouts = {name: group.layout for name, group in trainer.roles.items()}
        assert (layouts["policy"].tensor_model_parallel_size, layouts["reference"].data_parallel_size) == (2, 2)
        captured = {}
        close = trainer.on_close

        def inspect_then_close():
            captured["policy"] = _hf_weights_per_rank(trainer.roles["policy"])
            captured["reference"] = _hf_weights_per_rank(trainer.roles["reference"])
            close()

        trainer.on_close = inspect_then_close
        trainer.run()
    finally:
        server.stop()

    rows = read_metrics(str(tmp_path / "out"))
    assert [row["step"] for row in rows] == [0, 1]
    kl = [row["policy/kl_loss"] for row in rows]
    assert all(math.isfinite(v) for v in kl)
    # fp32 tolerance: the TP=2 policy and the TP=1 reference sum in different orders.
    assert abs(kl[0]) < 1e-5, kl
    assert kl[1] > 1e-4 and kl[1] > 100 * abs(kl[0]), kl
    exchange_keys = [key for key in rows[1] if key.startswith("exchange/")]
    assert not [key for key in rows[0] if key.startswith("exchange/")], "refreshed after step 0 (interval is 2)"
    assert "exchange/policy_to_reference/time_s" in exchange_keys

    policy = [w for w in captured["policy"] if w]
    assert len(policy) == 1, "one sender: TP rank 0 of the single DP replica"
    policy = policy[0]
    assert rows[1]["exchange/policy_to_reference/weights_tensors"] == len(policy)
    initial = load_file(f"{files['policy']}/model.safetensors")
    assert any(not torch.equal(policy[name], initial[name]) for name in policy), "the policy never trained"
    assert len(captured["reference"]) == 2
    for rank, reference in enumerate(captured["reference"]):
        assert reference.keys() == policy.keys(), rank
        for name in policy:
            assert reference[name].dtype == policy[name].dtype
            assert torch.equal(reference[name], policy[name]), (rank, name)
