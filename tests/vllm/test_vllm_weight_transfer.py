"""vLLM's own weight-transfer API against the session's real vLLM server (`--vllm-weight-transfer gloo`): the
trainer's side (`VllmEngine(weight_transport="gloo")`: /get_world_size, /init_weight_transfer_engine once,
then per push /start_weight_update, /update_weights per bucket while it broadcasts, /finish_weight_update,
/update_weight_version) and Stacx's `stacx_gloo` engine in vLLM's worker. The NCCL path sends the same
messages with another group: tests/rollout/test_vllm_nccl_weight_push_gpu.py (marked gpu)."""

from __future__ import annotations

import pytest

from tests.vllm.test_vllm_engine import greedy, push_checkpoint, trainer_log_probs, PROMPTS

pytestmark = pytest.mark.vllm


def test_weights_through_vllms_transfer_api_change_the_output_pass_the_check_and_move_the_version(
        vllm_server, vllm_checkpoints):
    import requests

    from stacx.rollout.engines.vllm import VllmEngine

    served, update = vllm_checkpoints
    url = vllm_server[0]
    buckets, gloo = VllmEngine(url), VllmEngine(url, weight_transport="gloo")
    try:
        push_checkpoint(buckets, served)  # Stacx's buckets first: the two ways share the version order
        before = greedy(buckets)
        version = push_checkpoint(gloo, update)  # checked after the push: every tensor's digest equals the sent one
        after = greedy(buckets)
        assert after != before and buckets.weight_version() == version
        (ref,) = trainer_log_probs(update, [list(PROMPTS[0]) + after[0]])
        assert after[0] == [int(ref[len(PROMPTS[0]) - 1 + j].argmax()) for j in range(len(after[0]))]
        assert requests.get(url + "/weight_info", timeout=30).json() == {"weight_version": str(version)}
        assert push_checkpoint(gloo, served) == version + 1  # the group is kept for the next push
        assert greedy(buckets) == before
        with pytest.raises(Exception, match="not newer"):
            gloo.update_weights([[("model.norm.weight", None)]], version=version)
    finally:
        gloo.shutdown()
        buckets.shutdown()
