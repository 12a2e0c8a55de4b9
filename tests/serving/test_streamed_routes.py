"""The CPU engine's streamed pieces (issue 44) carry what its answer carries, routed experts included: a streamed
`/generate` reads each request's output and route rows while both decoders build them (`AbortFlag.output`,
`AbortFlag.routes`), and the pieces it would send at any moment, joined, equal the answer. The stream is read here
from inside the decoding loop, before and after every token is recorded, so no thread timing decides what it sees.
"""

from __future__ import annotations

import pytest
import torch

from stacx.serving.generate_stream import progress
from stacx.wire.generate_progress import extend_output
from stacx.wire.types import GenerateOutput, GenerateRequest, SamplingParams
from tests.models.test_moe import save_moe_checkpoint
from tests.serving.fixtures import single_process_world  # noqa: F401  (a fixture, found by name)

REQUESTS = [GenerateRequest(input_ids=(3, 9, 14, 2), return_routed_experts=True, logprob_start_len=0,
                            top_logprobs_num=2, token_ids_logprob=(5,), rid="a",
                            sampling=SamplingParams(max_new_tokens=4, temperature=1.0, seed=1, ignore_eos=True)),
            GenerateRequest(input_ids=(7,), return_routed_experts=True, rid="b",
                            sampling=SamplingParams(max_new_tokens=3, temperature=1.0, seed=2, ignore_eos=True))]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_stream")
    save_moe_checkpoint("qwen3_moe", str(path), seed=3)
    return str(path)


@pytest.mark.slow  # ~17 s of CPU on 2 cores, most of it the MoE checkpoint, megatron's import and the layout
@pytest.mark.parametrize("decoding", ["packed", "kv_cache"])
def test_pieces_read_while_the_cpu_engine_decodes_join_to_its_answer(moe_checkpoint, single_process_world,
                                                                     decoding, monkeypatch):
    from stacx.serving.cpu_engine import CpuEngine

    engine = CpuEngine.from_hf_checkpoint(moe_checkpoint, decoding=decoding)
    flags = engine.aborts.register([r.rid for r in REQUESTS])
    sent, pieces, record = [0] * len(REQUESTS), [], engine._record_token

    def read_around(*args):  # the stream reads before and after each token is recorded
        pieces.extend(progress(flags, REQUESTS, sent))
        going_on = record(*args)
        pieces.extend(progress(flags, REQUESTS, sent))
        return going_on

    monkeypatch.setattr(engine, "_record_token", read_around)
    outputs = engine.generate(REQUESTS, abort_flags=flags)
    pieces.extend(progress(flags, REQUESTS, sent))
    joined = [GenerateOutput(output_ids=[], finish_reason="abort") for _ in REQUESTS]
    for piece in pieces:
        extend_output(joined[piece["index"]], REQUESTS[piece["index"]], piece)
    assert len(pieces) >= 7  # a piece per token
    for request, whole, answer in zip(REQUESTS, joined, outputs):
        for name in ("output_ids", "output_log_probs", "input_log_probs", "input_top_log_probs",
                     "output_top_log_probs", "input_token_ids_log_probs", "output_token_ids_log_probs",
                     "output_token_versions", "weight_version"):
            assert getattr(whole, name) == getattr(answer, name), name
        rows = len(request.input_ids) + len(answer.output_ids) - 1
        assert answer.routed_experts.shape[0] == rows
        assert torch.equal(whole.routed_experts, answer.routed_experts.to(torch.int32).reshape(rows, -1))
