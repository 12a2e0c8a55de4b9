"""The KV-cache mirror of dense models built without `transformers` (stacx.serving.dense_mirror): the same
parameter names and shapes as `transformers`' model, the same rotary table bit for bit, and the same logits
bit for bit when the CPU engine's lean forward decodes on either mirror (fp32)."""

import pytest
import torch

from stacx.models.architectures import decoder_shape
from stacx.serving.cpu_engine import CpuEngine
from stacx.serving.dense_mirror import DefaultRotaryTable, DenseMirror
from stacx.serving.kv_cache_decoding import KvCacheDecoder
from stacx.wire.types import GenerateRequest, SamplingParams


def _engine(arch, single_process_world, **overrides):
    from stacx.models import build_model
    from stacx.models.testing import tiny_hf_config

    torch.manual_seed(0)
    return CpuEngine(build_model(tiny_hf_config(arch, **overrides), single_process_world))


@pytest.mark.parametrize("head_dim,theta,dtype", [(16, 10000.0, torch.float32), (32, 1e6, torch.float32),
                                                  (16, 500000.0, torch.bfloat16)])
def test_rotary_table_equals_transformers_bit_for_bit(head_dim, theta, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=theta)
    positions_BP = torch.arange(300).view(2, 150)
    x = torch.zeros(1, dtype=dtype)
    expected = LlamaRotaryEmbedding(config)(x, positions_BP)
    got = DefaultRotaryTable(head_dim, theta)(x, positions_BP)
    assert all(torch.equal(g, e) and g.dtype == dtype for g, e in zip(got, expected))


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_lean_mirror_names_shapes_and_logits_equal_the_transformers_mirror(arch, tied, single_process_world):
    """llama: tied embeddings; qwen2: q/k/v biases; qwen3: per-head q/k norms."""
    engine = _engine(arch, single_process_world, tie_word_embeddings=tied)
    lean = engine._cached_decoder
    reference = KvCacheDecoder(engine.model, engine.groups, lean_mirror=False)
    assert isinstance(lean.hf_model, DenseMirror) and not isinstance(reference.hf_model, DenseMirror)
    assert lean.dense is not None and reference.dense is not None
    lean_shapes = {name: tuple(p.shape) for name, p in lean.hf_model.named_parameters()}
    assert lean_shapes == {name: tuple(p.shape) for name, p in reference.hf_model.named_parameters()}
    assert (lean.hf_model.lm_head.weight is lean.hf_model.model.embed_tokens.weight) == tied

    prompts = [[4, 10, 11, 12, 13, 14], [4, 20], [5, 6, 7, 8]]  # left padding
    batches = [decoder.prefill(prompts, num_prompt_logits=3, max_new_tokens=5) for decoder in (lean, reference)]
    assert torch.equal(batches[0].prompt_logits_BKV, batches[1].prompt_logits_BKV)
    logits = [batch.prompt_logits_BKV[:, -1] for batch in batches]
    for step in range(4):
        tokens = logits[1].argmax(-1).tolist()
        if step == 2:  # a row leaves the batch in the middle
            for batch in batches:
                batch.keep_rows([0, 2])
            tokens = [tokens[0], tokens[2]]
        logits = [batch.step(tokens) for batch in batches]
        assert torch.equal(logits[0], logits[1])


def test_a_dense_engine_builds_no_transformers_model_and_others_still_do(single_process_world, monkeypatch):
    import transformers

    from stacx.models.testing import tiny_hf_config

    def refuse(*args, **kwargs):
        raise AssertionError("a transformers model was built for a dense model's mirror")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    engine = _engine("qwen3", single_process_world)
    [output] = engine.generate([GenerateRequest(input_ids=(4, 10, 11), sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))])
    assert isinstance(engine._cached_decoder.hf_model, DenseMirror) and len(output.output_ids) == 4
    # mixture of experts and scaled rotary embeddings (llama3) keep transformers' mirror
    assert not DenseMirror.supports(decoder_shape(tiny_hf_config("qwen3_moe")))
    llama3 = tiny_hf_config("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    assert not DenseMirror.supports(decoder_shape(llama3))
