"""torch_dist optimizer keys of megatron's optimizer chain (an MoE model at ep > 1 keeps its expert parameters
in a second optimizer): recognized as optimizer state, and a resume across chain layouts refused by name."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from stacx.checkpointing.torch_dist import TorchDistCheckpointError, _require_same_optimizer_chain, is_optimizer_key


def test_chained_and_plain_optimizer_keys_are_optimizer_state():
    assert is_optimizer_key("optimizer.state.exp_avg.decoder.final_layernorm.weight")
    assert is_optimizer_key("chained_1.optimizer.state.exp_avg_sq.decoder.layers.mlp.experts.experts.linear_fc1.weight")
    assert not is_optimizer_key("decoder.final_layernorm.weight")
    assert not is_optimizer_key("decoder.layers.0.optimizer.weight")


def test_a_resume_across_optimizer_chain_layouts_names_the_flag():
    chained_keys = {"chained_0.optimizer.state.exp_avg.w", "chained_1.optimizer.state.exp_avg.e", "w"}
    plain_keys = {"optimizer.state.exp_avg.w", "w"}
    one, chain = SimpleNamespace(), SimpleNamespace(chained_optimizers=[object(), object()])
    _require_same_optimizer_chain(chained_keys, chain, Path("ck"), "--load")
    _require_same_optimizer_chain(plain_keys, one, Path("ck"), "--load")
    _require_same_optimizer_chain(plain_keys, SimpleNamespace(chained_optimizers=[object()]), Path("ck"), "--load")
    for keys, optimizer in ((chained_keys, one), (plain_keys, chain)):
        with pytest.raises(TorchDistCheckpointError, match=r"--load ck: .*--expert-model-parallel-size"):
            _require_same_optimizer_chain(keys, optimizer, Path("ck"), "--load")
