"""`forward_packed(..., lm_head="hidden")`: the LM head's inputs instead of its logits, in one process."""

from __future__ import annotations

import pytest
import torch

from stacx.parallel.lm_head import LMHeadShard


@pytest.fixture(scope="module")
def groups():
    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.serving.cpu_engine import ensure_single_process_layout

    yield ensure_single_process_layout()
    destroy_parallel_layout()


@pytest.mark.parametrize("tied", [False, True])
def test_the_shard_is_the_head_input_and_its_logits_are_the_logits_path(groups, tied):
    from stacx.models import build_model, forward_packed
    from stacx.models.testing import tiny_hf_config

    torch.manual_seed(0)
    model = build_model(tiny_hf_config("qwen3", vocab_size=101, tie_word_embeddings=tied), groups)
    tokens = torch.randint(0, 101, (10,))
    logits = forward_packed(model, tokens, [4, 6], groups)
    shard = forward_packed(model, tokens, [4, 6], groups, lm_head="hidden")
    assert isinstance(shard, LMHeadShard) and shard.hidden.shape == (10, 64) and shard.vocab_size == 101
    # The weight is the parameter the head multiplies: the tied embedding, or the head's own.
    expected = model.embedding.word_embeddings.weight if tied else model.output_layer.weight
    assert shard.weight is expected
    torch.testing.assert_close(shard.logits(), logits, rtol=1e-6, atol=1e-6)
    assert "forward" not in vars(model.output_layer)  # the class's forward is back
    shard.logits().sum().backward()  # a loss on the shard reaches the weight parameter
    assert expected.grad is not None and expected.grad.abs().max() > 0


def test_unsupported_heads_are_refused_and_the_head_is_left_alone(groups):
    from stacx.models import build_model, forward_packed
    from stacx.models.testing import tiny_hf_config

    model = build_model(tiny_hf_config("llama", vocab_size=101), groups)
    tokens = torch.randint(0, 101, (6,))
    with pytest.raises(ValueError, match="lm_head must be one of"):
        forward_packed(model, tokens, [6], groups, lm_head="values")
    model.output_layer.bias = torch.nn.Parameter(torch.zeros(101))
    with pytest.raises(ValueError, match=r"an output-layer bias.*--lm-head-log-probs logits"):
        forward_packed(model, tokens, [6], groups, lm_head="hidden")
    model.output_layer.bias = None
    assert "forward" not in vars(model.output_layer)
    assert forward_packed(model, tokens, [6], groups).shape == (6, 101)
