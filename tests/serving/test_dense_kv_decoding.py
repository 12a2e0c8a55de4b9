"""The CPU engine's lean dense forward (dense_kv_decoding.py) and batched token choice (batched_sampling.py)
against the `transformers` cached path and the per-row sampler they replace (fp32)."""

import pytest
import torch

from stacx.serving.batched_sampling import ARGMAX_BLOCK, choose_tokens, first_argmax
from stacx.serving.cpu_engine import CpuEngine, filter_top_k_top_p, sample_token
from stacx.serving.dense_kv_decoding import DenseKvDecoder, PackedLinear, onednn_packing_available
from stacx.serving.kv_cache_decoding import KvCacheDecoder
from stacx.wire.types import SamplingParams

TOLERANCE = 1e-5


def test_batched_choice_makes_the_per_row_draws():
    torch.manual_seed(0)
    log_probs_BV = torch.log_softmax(torch.randn(7, 300) * 3, dim=-1)
    samplings = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
                 SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
                 SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0),
                 SamplingParams(temperature=0.0)]
    for seed in range(5):
        shared = torch.Generator().manual_seed(seed)  # unseeded rows share the engine's generator
        generators = [torch.Generator().manual_seed(100 + seed) if s.seed is not None else shared for s in samplings]
        expected = [sample_token(lp, s, g) for lp, s, g in zip(log_probs_BV, samplings, generators)]
        shared.manual_seed(seed)
        generators[1].manual_seed(100 + seed)
        assert choose_tokens(log_probs_BV, samplings, generators, filter_top_k_top_p) == expected


@pytest.mark.parametrize("vocab_size", [32000, 32000 + 77, 151936, 300])
def test_blocked_argmax_is_torch_argmax_ties_and_nan_included(vocab_size):
    torch.manual_seed(0)
    x_BV = torch.log_softmax(torch.randn(9, vocab_size) * 3, dim=-1)
    x_BV[1, [5, vocab_size - 1]] = x_BV[1].max() + 1  # a tie across blocks: the first one
    x_BV[2, [ARGMAX_BLOCK + 3, ARGMAX_BLOCK + 9]] = x_BV[2].max() + 1  # a tie inside a block
    x_BV[3, vocab_size - 1] = x_BV[3].max() + 1  # the maximum in the last column (past the whole blocks)
    x_BV[4, 17] = float("nan")  # NaN counts as the maximum, as torch.argmax has it
    x_BV[5, vocab_size - 2] = float("nan")
    x_BV[6] = float("-inf")
    x_BV[7, [40, vocab_size - 3]] = float("nan")
    assert torch.equal(first_argmax(x_BV), x_BV.argmax(dim=-1))


def _decoders(arch, single_process_world, **overrides):
    from stacx.models import build_model
    from stacx.models.testing import tiny_hf_config

    torch.manual_seed(0)
    engine = CpuEngine(build_model(tiny_hf_config(arch, **overrides), single_process_world))
    return engine, engine._cached_decoder


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("qwen2", True)])
def test_dense_forward_equals_transformers_forward(arch, tied, single_process_world):
    engine, decoder = _decoders(arch, single_process_world, tie_word_embeddings=tied)
    assert decoder.dense is not None  # the default for dense llama-family models
    prompts = [[4, 10, 11, 12, 13, 14], [4, 20], [5, 6, 7, 8]]  # left padding
    lean = decoder.prefill(prompts, num_prompt_logits=3, max_new_tokens=6)
    # transformers' model and its own forward on the same weights
    transformers_decoder = KvCacheDecoder(engine.model, engine.groups, lean_mirror=False)
    transformers_decoder.dense = None
    reference = transformers_decoder.prefill(prompts, num_prompt_logits=3, max_new_tokens=6)
    # prompt positions that exist (left padding: the shortest prompt has 2)
    assert torch.allclose(lean.prompt_logits_BKV[:, -2:], reference.prompt_logits_BKV[:, -2:], atol=TOLERANCE)
    assert torch.allclose(lean.prompt_logits_BKV[0], reference.prompt_logits_BKV[0], atol=TOLERANCE)
    logits = (lean.prompt_logits_BKV[:, -1], reference.prompt_logits_BKV[:, -1])
    for step in range(5):
        assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
        tokens = logits[1].argmax(-1).tolist()
        if step == 2:  # a row leaves the batch in the middle
            lean.keep_rows([0, 2])
            reference.keep_rows([0, 2])
            tokens = [tokens[0], tokens[2]]
        logits = (lean.step(tokens), reference.step(tokens))
        assert torch.allclose(logits[0], logits[1], atol=TOLERANCE)


def test_only_dense_llama_family_models_take_the_lean_forward(single_process_world):
    _, moe = _decoders("qwen3_moe", single_process_world)
    assert moe.dense is None
    _, dense = _decoders("llama", single_process_world)
    assert DenseKvDecoder.supports(dense.hf_model)
    dense.hf_model.config.layer_types = ["sliding_attention"] * len(dense.hf_model.model.layers)
    assert not DenseKvDecoder.supports(dense.hf_model)  # a layer that sees only a window: transformers' path


def test_packed_linear_equals_linear_and_follows_repacking():
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32) * 0.1, torch.randn(48)
    x = torch.randn(3, 5, 32)
    linear = PackedLinear(weight, bias)
    linear.pack(onednn_packing_available())
    assert torch.allclose(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5)
    weight.mul_(2)  # a weight sync writes the parameter: the packed copy is stale until `pack`
    linear.pack(onednn_packing_available())
    assert torch.allclose(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5)
    linear.pack(False)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, weight, bias))
