"""The critic's value head."""

from __future__ import annotations

import torch

from stacx.trainer.runtime.value_head import ValueHead


def test_value_head_matches_a_linear_map_of_the_final_hidden_states():
    head = ValueHead(4, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, -2.0, 0.5, 0.0]], dtype=torch.float64))
        head.bias.fill_(0.25)
    hidden = torch.randn(3, 1, 4, dtype=torch.float64)
    values, bias = head(hidden, weight=torch.ones(9, 4))
    assert bias is None and values.shape == (3, 1, 1)
    expected = hidden[..., 0] - 2 * hidden[..., 1] + 0.5 * hidden[..., 2] + 0.25
    assert torch.allclose(values[..., 0], expected)
