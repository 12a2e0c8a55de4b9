"""Routing replay (R3): the CPU engine returns each token's experts; the trainer's forward replays them.

One tiny Qwen3-MoE checkpoint (a router sharp enough that top-2 choices differ per token), in process:
- both decodings of the CPU engine return, for prompt and output tokens (all but the last output),
  exactly the experts the trainer's own forward of that sequence routes to (fp32);
- replaying the model's own routes changes nothing (bitwise), through `MicroBatch.model_routes` (tokens
  no engine ran route themselves);
- an engine in bf16 routes some tokens elsewhere than the fp32 trainer; replaying its routes makes the
  trainer use those experts, moves its log-probs towards the engine's, and still trains the router;
- `model_routes` slices the routes as the CP layout slices the tokens.
"""

from __future__ import annotations

import pytest
import torch

from stacx.specializations.batch import MicroBatch
from stacx.wire.types import GenerateRequest, SamplingParams
from tests.models.test_moe import save_moe_checkpoint
from tests.serving.fixtures import single_process_world  # noqa: F401  (a fixture, found by name)

PROMPTS = [(3, 9, 14, 2, 7, 11), (5, 1, 8), (12, 4, 6, 10, 13)]
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_r3")
    save_moe_checkpoint("qwen3_moe", str(path), seed=3)
    return str(path)


def _requests(temperature=1.0):
    return [GenerateRequest(input_ids=p, return_routed_experts=True,
                            sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=temperature, seed=i,
                                                    ignore_eos=True))
            for i, p in enumerate(PROMPTS)]


def _trainer_model(path, world):
    from stacx.models import build_model, load_hf_checkpoint

    model = build_model(path, world)
    load_hf_checkpoint(model, path, world)
    return model


def _micro_batch(outputs, requests, routed=True):
    sequences = [torch.tensor(list(r.input_ids) + o.output_ids) for r, o in zip(requests, outputs)]
    lengths = [len(o.output_ids) for o in outputs]
    fields = dict(loss_masks=[torch.ones(n) for n in lengths])
    if routed:
        fields["routed_experts"] = [o.routed_experts for o in outputs]
    return MicroBatch.pack(sequences, lengths, **fields)


def _response_log_probs(model, batch, world, routes=None):
    """Per-token log-probs of the responses [sum R_i] (and the routes the forward took)."""
    from stacx.models import forward_packed
    from stacx.models.routing_replay import RoutesRecorder, routes_replayed

    tokens, lengths = batch.model_inputs()
    with RoutesRecorder(model) as recorder:
        if routes is None:
            logits = forward_packed(model, tokens, lengths, world)
        else:
            with routes_replayed(model, routes):
                logits = forward_packed(model, tokens, lengths, world)
    log_probs = torch.log_softmax(logits.double(), -1)
    picked = []
    offset = 0
    for length, response in zip(lengths, batch.response_lengths):
        seq = tokens[offset:offset + length]
        start = length - response
        picked.append(log_probs[offset + start - 1: offset + length - 1].gather(1, seq[start:, None])[:, 0])
        offset += length
    return torch.cat(picked), recorder.routes()


@pytest.mark.parametrize("decoding", ["kv_cache", "packed"])
def test_engine_routes_are_the_trainer_forwards_routes(moe_checkpoint, single_process_world, decoding):
    from stacx.serving.cpu_engine import CpuEngine

    engine = CpuEngine.from_hf_checkpoint(moe_checkpoint, decoding=decoding)
    requests = _requests()
    outputs = engine.generate(requests)
    model = _trainer_model(moe_checkpoint, single_process_world)
    batch = _micro_batch(outputs, requests)
    _, own_routes = _response_log_probs(model, batch, single_process_world)
    offset = 0
    for request, output in zip(requests, outputs):
        length = len(request.input_ids) + len(output.output_ids)
        assert output.routed_experts.dtype == torch.int32
        assert tuple(output.routed_experts.shape) == (length - 1, 2, 2)  # [tokens run, layers, top_k]
        assert torch.equal(output.routed_experts, own_routes[offset:offset + length - 1])
        offset += length
    assert len(set(map(tuple, own_routes[:, 0].tolist()))) > 2  # tokens go to different experts
    plain = engine.generate([GenerateRequest(input_ids=PROMPTS[0], sampling=requests[0].sampling)])[0]
    assert plain.routed_experts is None and plain.output_ids == outputs[0].output_ids


def test_replaying_the_models_own_routes_changes_nothing(moe_checkpoint, single_process_world):
    from stacx.serving.cpu_engine import CpuEngine

    engine = CpuEngine.from_hf_checkpoint(moe_checkpoint, decoding="packed")
    requests = _requests()
    outputs = engine.generate(requests)
    model = _trainer_model(moe_checkpoint, single_process_world)
    batch = _micro_batch(outputs, requests)
    plain, own = _response_log_probs(model, batch, single_process_world)
    routes = batch.model_routes()
    replayed, taken = _response_log_probs(model, batch, single_process_world, routes=routes)
    assert torch.equal(plain, replayed)
    run = routes[:, 0, 0] >= 0
    assert int((~run).sum()) == len(outputs)  # each sequence's last token: no engine ran it, it routes itself
    assert torch.equal(taken[run], routes[run]) and torch.equal(taken, own)
    engine_log_probs = torch.tensor([lp for o in outputs for lp in o.output_log_probs], dtype=torch.float64)
    assert (replayed - engine_log_probs).abs().max() <= 1e-5


def test_replay_of_a_bf16_engines_routes(moe_checkpoint, single_process_world):
    from stacx.models import build_model, load_hf_checkpoint
    from stacx.serving.cpu_engine import CpuEngine

    bf16 = build_model(moe_checkpoint, single_process_world, params_dtype=torch.bfloat16)
    load_hf_checkpoint(bf16, moe_checkpoint, single_process_world)
    engine = CpuEngine(bf16, decoding="kv_cache")
    requests = [GenerateRequest(input_ids=tuple((7 * i + 3 * j) % 16 for j in range(12)), return_routed_experts=True,
                                sampling=SamplingParams(max_new_tokens=16, seed=i, ignore_eos=True))
                for i in range(16)]
    outputs = engine.generate(requests)
    model = _trainer_model(moe_checkpoint, single_process_world)
    model.train()
    batch = _micro_batch(outputs, requests)
    engine_log_probs = torch.tensor([lp for o in outputs for lp in o.output_log_probs], dtype=torch.float64)
    with torch.no_grad():
        plain, own = _response_log_probs(model, batch, single_process_world)
    routes = batch.model_routes()
    run = routes[:, 0, 0] >= 0  # tokens the engine ran
    differs = (own[run] != routes[run]).any(-1)
    assert differs.any(), "the guard: bf16 routing must differ from fp32 routing somewhere"
    replayed, taken = _response_log_probs(model, batch, single_process_world, routes=routes)
    assert torch.equal(taken[run], routes[run])
    # Where the replayed routes change a response log-prob (a route that differs in the last layer at a prompt
    # token changes none), the trainer's log-prob moves towards the engine's.
    changed = replayed.detach() != plain
    assert changed.any(), "the guard: some differing route must reach a response log-prob"
    assert ((replayed.detach() - engine_log_probs)[changed].abs().mean()
            < (plain - engine_log_probs)[changed].abs().mean())
    replayed.sum().backward()
    router_grads = [p.grad for n, p in model.named_parameters() if n.endswith("router.weight")]
    assert router_grads and all(g is not None and g.abs().sum() > 0 for g in router_grads)


def test_model_routes_follow_the_cp_layout():
    lengths, responses = [6, 9], [2, 4]
    sequences = [torch.arange(n) + 100 * i for i, n in enumerate(lengths)]
    # a route that names its token: expert ids (token id, token id + 1000) in layer 0
    routes = [torch.stack([s[:-1], s[:-1] + 1000], -1)[:, None, :].int() for s in sequences]
    for cp_rank in (0, 1):
        groups = type("G", (), {"cp_rank": cp_rank, "cp_size": 2})()
        batch = MicroBatch.pack(sequences, responses, groups=groups, loss_masks=[torch.ones(r) for r in responses],
                                routed_experts=routes)
        tokens, _ = batch.model_inputs()
        local = batch.model_routes()
        assert local.shape == (tokens.shape[0], 1, 2)
        run = local[:, 0, 1] >= 1000  # tokens the engine ran; the rest (last tokens, padding) hold -1
        assert torch.equal(local[run, 0, 0], tokens[run])
        assert bool((local[~run] == -1).all())
        assert int(run.sum()) > 0 and int((~run).sum()) > 0


def test_routes_travel_from_the_rollout_manager_to_the_micro_batch(moe_checkpoint, single_process_world):
    from stacx.rollout.continuation import join_outputs
    from stacx.rollout.manager import RolloutManager
    from stacx.serving.cpu_engine import CpuEngine
    from stacx.trainer.batch import StepBatch
    from stacx.wire.types import GenerateOutput

    engine = CpuEngine.from_hf_checkpoint(moe_checkpoint)
    manager = RolloutManager(engine, reward_fn=lambda text, label, metadata: 0.0, return_routed_experts=True)
    samples = manager.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, ignore_eos=True), n_samples_per_prompt=2)
    assert all(tuple(s.routed_experts.shape) == (len(s.tokens) - 1, 2, 2) for s in samples)
    batch = StepBatch.from_samples(samples)
    micro_batch = batch.select([3, 0]).pack()
    assert torch.equal(micro_batch.routed_experts[0], samples[3].routed_experts)
    assert micro_batch.model_routes().shape == (sum(len(s.tokens) for s in (samples[3], samples[0])), 2, 2)
    samples[1].routed_experts = None  # e.g. an environment episode: the step stops naming the flag
    with pytest.raises(ValueError, match="--use-routing-replay"):
        StepBatch.from_samples(samples)
    # A partial rollout's continuation ran the whole sequence again: its routes are the joined output's.
    so_far = GenerateOutput(output_ids=[7], output_token_versions=[0], finish_reason="abort",
                            routed_experts=torch.zeros(3, 2, 2, dtype=torch.int32))
    continued = GenerateOutput(output_ids=[8, 9], output_token_versions=[1, 1],
                               routed_experts=torch.ones(5, 2, 2, dtype=torch.int32))
    assert torch.equal(join_outputs(so_far, continued).routed_experts, continued.routed_experts)
