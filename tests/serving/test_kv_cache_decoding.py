"""The KV-cache decoder of the CPU engine against the trainer's packed forward and the packed decoder (fp32)."""

import pytest
import torch

from stacx.serving.cpu_engine import CpuEngine
from stacx.wire.engine import GenerationCancelled
from stacx.wire.types import GenerateRequest, SamplingParams

TOLERANCE = 1e-5  # fp32 cached decoder vs fp32 trainer forward of the same tokens


def packed_log_probs(model, groups, sequence, temperature=1.0):
    """The trainer's packed forward of one sequence: log_softmax(logits / T) [len, V] in float64."""
    from stacx.models import forward_packed, hf_config_of

    with torch.no_grad():
        logits = forward_packed(model, torch.tensor(sequence), [len(sequence)], groups)
    return torch.log_softmax(logits[:, : hf_config_of(model).vocab_size].double() / temperature, -1)


def mixed_requests(max_new_tokens=7):
    """Prompts of different lengths (left padding matters), greedy and sampled, every log-prob field."""
    return [
        GenerateRequest(input_ids=(4, 10, 11, 12, 13, 14, 15), logprob_start_len=2, top_logprobs_num=3,
                        token_ids_logprob=(8, 9),
                        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)),
        GenerateRequest(input_ids=(4, 20), logprob_start_len=0,
                        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, top_k=9, top_p=0.95,
                                                seed=5, ignore_eos=True)),
        GenerateRequest(input_ids=(4, 30, 31, 32),
                        sampling=SamplingParams(max_new_tokens=max_new_tokens - 3, temperature=1.2, seed=6,
                                                ignore_eos=True)),
        GenerateRequest(input_ids=(5, 6, 7), top_logprobs_num=2,
                        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)),
    ]


@pytest.fixture(scope="module")
def engines(tiny_checkpoints, single_process_world):
    cached = CpuEngine.from_hf_checkpoint(tiny_checkpoints[0])
    packed = CpuEngine.from_hf_checkpoint(tiny_checkpoints[0], decoding="packed")
    assert cached.decoding == "kv_cache" and cached._cached_decoder is not None  # the default is the cached path
    return cached, packed


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("qwen3", False), ("qwen3_moe", False),
                                       ("qwen2_moe", False)])
def test_cached_log_probs_equal_trainer_forward(arch, tied, single_process_world):
    from stacx.models import build_model
    from stacx.models.testing import tiny_hf_config

    torch.manual_seed(0)
    model = build_model(tiny_hf_config(arch, tie_word_embeddings=tied), single_process_world)
    engine = CpuEngine(model)
    requests = mixed_requests()
    outputs = engine.generate(requests)
    for request, output in zip(requests, outputs):
        temperature = request.sampling.temperature or 1.0
        ref = packed_log_probs(model, single_process_world, list(request.input_ids) + output.output_ids, temperature)
        prompt_len = len(request.input_ids)
        assert len(output.output_ids) == request.sampling.max_new_tokens
        expected = [ref[prompt_len - 1 + j, t].item() for j, t in enumerate(output.output_ids)]
        assert max(abs(a - b) for a, b in zip(output.output_log_probs, expected)) <= TOLERANCE
        if request.sampling.temperature == 0:
            assert output.output_ids == [int(ref[prompt_len - 1 + j].argmax()) for j in range(len(output.output_ids))]
        if request.top_logprobs_num:
            for j, top in enumerate(output.output_top_log_probs):
                assert [t for _, t in top] == ref[prompt_len - 1 + j].topk(request.top_logprobs_num).indices.tolist()
        if request.return_logprob and request.logprob_start_len >= 0:
            positions = range(request.logprob_start_len, prompt_len)
            assert len(output.input_log_probs) == len(positions)
            for value, p in zip(output.input_log_probs, positions):
                if p == 0:
                    assert value is None
                else:
                    assert abs(value - ref[p - 1, request.input_ids[p]].item()) <= TOLERANCE
    first = outputs[0]
    ref = packed_log_probs(model, single_process_world, list(requests[0].input_ids))
    for k, p in enumerate(range(2, 7)):
        assert [t for _, t in first.input_top_log_probs[k]] == ref[p - 1].topk(3).indices.tolist()
        assert [lp for lp, _ in first.input_token_ids_log_probs[k]] == pytest.approx(
            [ref[p - 1, 8].item(), ref[p - 1, 9].item()], abs=TOLERANCE)
    full = packed_log_probs(model, single_process_world, list(requests[0].input_ids) + first.output_ids)
    assert len(first.output_token_ids_log_probs) == len(first.output_ids)
    for j, pairs in enumerate(first.output_token_ids_log_probs):
        assert [t for _, t in pairs] == [8, 9]
        assert [lp for lp, _ in pairs] == pytest.approx([full[6 + j, 8].item(), full[6 + j, 9].item()], abs=TOLERANCE)


def test_cached_matches_packed_decoder_token_for_token(engines):
    cached, packed = engines
    requests = mixed_requests(max_new_tokens=12)
    from_cache, from_packed = cached.generate(requests), packed.generate(requests)
    for a, b in zip(from_cache, from_packed):
        assert a.output_ids == b.output_ids  # greedy and seeded samples alike
        assert a.finish_reason == b.finish_reason
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=TOLERANCE)
        assert a.input_log_probs == pytest.approx(b.input_log_probs, abs=TOLERANCE)
        assert [[t for _, t in top] for top in a.output_top_log_probs] == \
            [[t for _, t in top] for top in b.output_top_log_probs]


def test_seeded_samples_reproduce_and_other_seeds_differ(engines):
    cached, _ = engines
    sampled = [GenerateRequest(input_ids=(4, 12, 13), sampling=SamplingParams(max_new_tokens=16, temperature=1.5,
                                                                             seed=11, ignore_eos=True))]
    first, again = cached.generate(sampled)[0], cached.generate(sampled)[0]
    assert first.output_ids == again.output_ids and first.output_log_probs == again.output_log_probs
    other_seed = [GenerateRequest(input_ids=(4, 12, 13), sampling=SamplingParams(max_new_tokens=16, temperature=1.5,
                                                                                seed=12, ignore_eos=True))]
    assert cached.generate(other_seed)[0].output_ids != first.output_ids  # the seed is really used


def test_rows_that_stop_leave_the_batch_and_others_go_on(engines):
    cached, packed = engines
    greedy = [GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                       ignore_eos=True))
              for prompt in ((4, 10, 11), (4, 21, 22, 23, 24), (4, 40))]
    reference = packed.generate(greedy)
    stop_token = reference[0].output_ids[2]  # request 0 stops at its third token, the others go on
    stopping = [GenerateRequest(input_ids=greedy[0].input_ids, sampling=SamplingParams(
        max_new_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_token,)))] + greedy[1:] + [
        GenerateRequest(input_ids=(4, 50), sampling=SamplingParams(max_new_tokens=0))]
    outputs, expected = cached.generate(stopping), packed.generate(stopping)
    assert outputs[0].finish_reason == "stop" and len(outputs[0].output_ids) <= 3
    assert outputs[3].output_ids == [] and outputs[3].finish_reason == "length"
    for a, b in zip(outputs, expected):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
    assert [o.output_ids for o in outputs[1:3]] == [r.output_ids for r in reference[1:3]]


def test_cached_decoder_sees_every_weight_update(tiny_checkpoints, single_process_world):
    from stacx.models import build_model, iter_hf_weight_buckets, load_hf_checkpoint

    engine = CpuEngine.from_hf_checkpoint(tiny_checkpoints[0])
    target = CpuEngine.from_hf_checkpoint(tiny_checkpoints[1], decoding="packed")
    greedy = [GenerateRequest(input_ids=(4, 15, 16), sampling=SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                            ignore_eos=True))]
    before = engine.generate(greedy)[0]
    source = build_model(tiny_checkpoints[1], single_process_world)
    load_hf_checkpoint(source, tiny_checkpoints[1], single_process_world)
    engine.update_weights(iter_hf_weight_buckets(source, single_process_world, bucket_bytes=20_000), version=2)
    after, expected = engine.generate(greedy)[0], target.generate(greedy)[0]
    assert after.weight_version == 2
    assert after.output_ids == expected.output_ids
    assert after.output_log_probs == pytest.approx(expected.output_log_probs, abs=TOLERANCE)
    assert after.output_log_probs != pytest.approx(before.output_log_probs, abs=1e-3)  # the update changed them

    # a custom weight loader writes the megatron model directly: the cache mirror follows it too
    def zero_loader(model, named_tensors):
        with torch.no_grad():
            model.output_layer.weight.zero_()

    zeroed = CpuEngine(build_model(tiny_checkpoints[0], single_process_world), weight_loader=zero_loader)
    zeroed.generate(greedy)
    zeroed.update_weights([[("lm_head.weight", torch.zeros(1))]], version=1)
    uniform = zeroed.generate(greedy)[0]
    vocab_size = zeroed.vocab_size
    assert uniform.output_log_probs == pytest.approx([-torch.log(torch.tensor(float(vocab_size))).item()] * 6,
                                                     abs=TOLERANCE)


def test_cancelled_cached_generation_raises(engines):
    cached, _ = engines
    calls = []
    long = [GenerateRequest(input_ids=(4, 10), sampling=SamplingParams(max_new_tokens=50, ignore_eos=True))]
    with pytest.raises(GenerationCancelled):
        cached.generate(long, should_stop=lambda: calls.append(1) or len(calls) > 3)
    assert cached.generate(long)[0].finish_reason == "length"  # the engine serves the next call
    assert cached.generate([]) == []


def test_unknown_decoding_is_refused(single_process_world):
    from stacx.models import build_model
    from stacx.models.testing import tiny_hf_config

    with pytest.raises(ValueError, match="decoding='cached'.*kv_cache"):
        CpuEngine(build_model(tiny_hf_config("llama"), single_process_world), decoding="cached")


def test_prefill_keeps_only_the_logits_it_needs(engines):
    # a long prompt without prompt log-probs never holds [prompt_len, V] logits (the 4k-prompt memory issue)
    cached, _ = engines
    batch = cached._cached_decoder.prefill([[4] * 120, [5] * 30], num_prompt_logits=1)
    assert tuple(batch.prompt_logits_BKV.shape) == (2, 1, cached.vocab_size)
    plain = GenerateRequest(input_ids=(4,) * 120, sampling=SamplingParams(max_new_tokens=1))
    from stacx.serving.cpu_engine import _first_prompt_logit

    assert _first_prompt_logit(plain) == 119  # only the last prompt position is asked for
    asked = GenerateRequest(input_ids=(4,) * 120, logprob_start_len=100, sampling=SamplingParams(max_new_tokens=1))
    assert _first_prompt_logit(asked) == 99
