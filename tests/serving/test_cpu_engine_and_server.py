"""The CPU engine and `stacx serve` against a separate forward of the trainer's model (fp32)."""

import threading
import time

import pytest
import torch

from stacx.objectives.distillation import TEACHER_EXECUTED_SENTINEL
from stacx.rollout.engines.http import HttpEngine
from stacx.rollout.manager import RolloutManager
from stacx.rollout.service import RolloutService
from stacx.rollout.teacher import TeacherClient
from stacx.parallel.tensor_digests import tensor_digest
from stacx.rollout.weight_check import WeightSyncMismatch, verify_engine_weights
from stacx.serving.cpu_engine import CpuEngine, draw_index, filter_top_k_top_p
from stacx.serving.server import EngineHttpServer
from stacx.trainer.batch import StepBatch
from stacx.wire.http_client import RetryPolicy
from stacx.wire.types import GenerateRequest, SamplingParams

TOLERANCE = 1e-5  # fp32 engine vs fp32 trainer forward of the same tokens


def trainer_log_probs(path, groups, sequences, temperature=1.0):
    """An independent reference: the trainer's model built and loaded anew, one packed forward."""
    from stacx.models import build_model, forward_packed, load_hf_checkpoint

    model = build_model(path, groups).eval()
    load_hf_checkpoint(model, path, groups)
    lengths = [len(s) for s in sequences]
    with torch.no_grad():
        logits = forward_packed(model, torch.tensor([t for s in sequences for t in s]), lengths, groups)
    from stacx.models import hf_config_of

    logits = logits[:, : hf_config_of(model).vocab_size].double()
    return [torch.log_softmax(x / temperature, -1) for x in torch.split(logits, lengths)]


def requests_for_test():
    return [
        GenerateRequest(input_ids=(4, 10, 11, 12), sampling=SamplingParams(max_new_tokens=6, temperature=0.7, seed=1),
                        logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=(8, 9)),
        GenerateRequest(input_ids=(4, 20), sampling=SamplingParams(max_new_tokens=5, temperature=1.3, top_k=7,
                                                                   top_p=0.9, seed=2, ignore_eos=True)),
        GenerateRequest(input_ids=(4, 30, 31), sampling=SamplingParams(max_new_tokens=4, temperature=0.0)),
    ]


def test_filter_top_k_top_p():
    log_probs = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(filter_top_k_top_p(log_probs, 2, 1.0)).tolist() == [False, False, True, True]
    # nucleus 0.7: 0.5 alone is below, 0.5 + 0.3 crosses -> keep two
    assert torch.isinf(filter_top_k_top_p(log_probs, -1, 0.7)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_top_k_top_p(log_probs, -1, 0.45)).tolist() == [False, True, True, True]


def test_draw_index_follows_the_probabilities_and_never_draws_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    draws = torch.tensor([draw_index(probs * 3.0, generator) for _ in range(40_000)])  # any positive total
    frequencies = torch.bincount(draws, minlength=probs.numel()).double() / draws.numel()
    assert frequencies[probs == 0].sum() == 0
    # 4 standard deviations of a frequency near 0.5 over 40,000 draws is 0.01
    assert (frequencies - probs).abs().max() < 0.01, frequencies
    # The same seed gives the same draws; all mass on one index draws it, even on the last index.
    first = [draw_index(probs, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert first == [draw_index(probs, torch.Generator().manual_seed(7)) for _ in range(3)]
    one_hot = torch.zeros(5, dtype=torch.float64)
    one_hot[4] = 1.0
    assert {draw_index(one_hot, generator) for _ in range(100)} == {4}


def test_server_stop_returns_whether_or_not_it_was_started():
    # socketserver's shutdown() waits for a serve_forever loop; stop() before start() must not hang.
    stopper = threading.Thread(target=EngineHttpServer(engine=None).stop, daemon=True)
    stopper.start()
    stopper.join(timeout=5)
    assert not stopper.is_alive(), "EngineHttpServer.stop() before start() hung"
    server = EngineHttpServer(engine=None).start()
    server.stop()
    server.stop()  # a second stop is harmless


def test_engine_log_probs_equal_trainer_forward(tiny_checkpoints, single_process_world):
    engine = CpuEngine.from_hf_checkpoint(tiny_checkpoints[0])
    requests = requests_for_test()
    outputs = engine.generate(requests)
    for request, output in zip(requests, outputs):
        assert len(output.output_ids) == len(output.output_log_probs) > 0
        temperature = request.sampling.temperature or 1.0
        (ref,) = trainer_log_probs(tiny_checkpoints[0], single_process_world,
                                   [list(request.input_ids) + output.output_ids], temperature)
        prompt_len = len(request.input_ids)
        expected = [ref[prompt_len - 1 + j, t].item() for j, t in enumerate(output.output_ids)]
        assert max(abs(a - b) for a, b in zip(output.output_log_probs, expected)) < TOLERANCE
        if request.sampling.temperature == 0:
            assert output.output_ids == [int(ref[prompt_len - 1 + j].argmax()) for j in range(len(output.output_ids))]
    first = outputs[0]
    (ref,) = trainer_log_probs(tiny_checkpoints[0], single_process_world, [list(requests[0].input_ids)], 0.7)
    assert first.input_log_probs[0] is None
    assert max(abs(first.input_log_probs[p] - ref[p - 1, requests[0].input_ids[p]].item()) for p in range(1, 4)) < TOLERANCE
    top = first.input_top_log_probs[2]
    assert [t for _, t in top] == ref[1].topk(3).indices.tolist()
    id_pairs = first.input_token_ids_log_probs[3]
    assert [t for _, t in id_pairs] == [8, 9]
    assert [lp for lp, _ in id_pairs] == pytest.approx([ref[2, 8].item(), ref[2, 9].item()], abs=TOLERANCE)
    # a fixed seed reproduces the same tokens; the second request ignored eos and ran to length
    assert engine.generate(requests[:2])[0].output_ids == first.output_ids
    assert outputs[1].finish_reason == "length" and len(outputs[1].output_ids) == 5


@pytest.mark.slow
def test_http_generation_weight_update_and_pause(tiny_checkpoints, single_process_world):
    from stacx.models import build_model, iter_hf_weight_buckets, load_hf_checkpoint

    engine = CpuEngine.from_hf_checkpoint(tiny_checkpoints[0])
    with EngineHttpServer(engine) as server:
        client = HttpEngine(server.url, RetryPolicy(timeout_s=60, max_attempts=2, backoff_s=0.05), api_key=server.api_key)
        assert client.health() and client.weight_version() == 0
        requests = requests_for_test()
        over_http = client.generate(requests)
        in_process = engine.generate(requests)
        for a, b in zip(over_http, in_process):
            assert a.output_ids == b.output_ids and a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-12)
            assert a.input_log_probs == pytest.approx(b.input_log_probs, abs=1e-12)

        # push the second checkpoint's weights in small buckets (q/k/v land in different buckets)
        source = build_model(tiny_checkpoints[1], single_process_world)
        load_hf_checkpoint(source, tiny_checkpoints[1], single_process_world)
        buckets = list(iter_hf_weight_buckets(source, single_process_world, bucket_bytes=20_000))
        assert len(buckets) > 5
        service = RolloutService(client, engine_kind="cpu", url=client.url, tokenizer=None, rollout_section=None)
        service.begin_weight_update()  # the one weight-update handshake: pause, stream, flush, resume, check
        client.update_weights(iter(buckets), version=3)
        service.finish_weight_update(3)
        assert client.weight_version() == 3
        # the post-sync check: every tensor stacx serve holds now equals the one sent; a changed one is named
        dtype = client.weight_digest_dtype()
        sent = {name: tensor_digest(tensor, dtype=dtype) for bucket in buckets for name, tensor in bucket}
        assert verify_engine_weights(client, sent, url=client.url, version=3) == {"checked": len(sent), "unverified": 0}
        norm = dict(tensor for bucket in buckets for tensor in bucket)["model.norm.weight"]
        engine.load_weights([("model.norm.weight", norm + 1.0)])
        with pytest.raises(WeightSyncMismatch, match="model.norm.weight"):
            verify_engine_weights(client, sent, url=client.url, version=3)
        engine.load_weights([("model.norm.weight", norm)])
        greedy = [GenerateRequest(input_ids=(4, 15, 16), sampling=SamplingParams(max_new_tokens=5, temperature=0.0,
                                                                                 ignore_eos=True))]
        (after,) = client.generate(greedy)
        assert after.weight_version == 3
        (ref,) = trainer_log_probs(tiny_checkpoints[1], single_process_world, [[4, 15, 16] + after.output_ids])
        assert after.output_ids == [int(ref[2 + j].argmax()) for j in range(5)]
        assert max(abs(lp - ref[2 + j, t].item()) for j, (lp, t) in
                   enumerate(zip(after.output_log_probs, after.output_ids))) < TOLERANCE

        # the same update through the request body (no shared memory) serves the same weights
        q_only = [(n, t) for bucket in buckets for n, t in bucket if n.endswith("q_proj.weight")][:1]
        engine.load_weights(q_only)  # leave linear_qkv waiting for k and v ...
        with pytest.raises(ValueError, match="weight update incomplete: parameter .*linear_qkv"):
            engine.set_weight_version(99)
        body_client = HttpEngine(server.url, weight_transport="http", api_key=server.api_key)
        body_client.update_weights(iter(buckets), version=4)  # ... the full push repairs it
        (again,) = body_client.generate(greedy)
        assert again.output_ids == after.output_ids and again.weight_version == 4
        assert again.output_log_probs == pytest.approx(after.output_log_probs, abs=1e-12)
        body_client.shutdown()

        # a paused server holds /generate until /continue_generation
        client.pause()
        done = threading.Event()
        worker = threading.Thread(target=lambda: (client.generate(greedy), done.set()))
        worker.start()
        time.sleep(0.5)
        assert not done.is_set()
        client.resume()
        worker.join(timeout=30)
        assert done.is_set()
        client.flush_cache()
        assert client.model_info()["weight_version"] == "4"
        # a malformed shared-memory update is the caller's mistake: 400 naming the missing field
        import requests as http

        key = {"Authorization": f"Bearer {server.api_key}"}
        staging = http.post(f"{server.url}/stacx/shm_staging", json={}, headers=key, timeout=10).json()
        reply = http.post(f"{server.url}/stacx/update_weights_from_shm", timeout=10, headers=key,
                          json={"staging_id": staging["staging_id"], "names": [], "dtypes": [], "shapes": [],
                                "offsets": [], "num_bytes": 0, "version": 5})
        assert reply.status_code == 400 and "final" in reply.json()["error"]
        client.shutdown()


@pytest.mark.slow
def test_teacher_and_manager_against_served_teacher(tiny_checkpoints, single_process_world):
    teacher_engine = CpuEngine.from_hf_checkpoint(tiny_checkpoints[1])
    student = CpuEngine.from_hf_checkpoint(tiny_checkpoints[0])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints[0])
    with EngineHttpServer(teacher_engine) as server:
        teacher = TeacherClient(server.url, sequences_per_request=2)
        sequences = [[4, 10, 11, 12, 13, 14], [4, 20, 21], [4, 5, 6, 7, 8]]
        response_lengths = [3, 1, 4]
        ids = [torch.randint(0, 50, (r, 4), generator=torch.Generator().manual_seed(r)) for r in response_lengths]
        scores = teacher.score(sequences, response_lengths, top_k=3, ids_per_position=ids)
        refs = trainer_log_probs(tiny_checkpoints[1], single_process_world, sequences)
        for seq, r_len, ref, sc, id_rows in zip(sequences, response_lengths, refs, scores, ids):
            positions = range(len(seq) - r_len, len(seq))
            expected = torch.tensor([ref[p - 1, seq[p]].item() for p in positions])
            assert torch.allclose(sc.log_probs.double(), expected.double(), atol=TOLERANCE)
            assert sc.top_ids.tolist() == [ref[p - 1].topk(3).indices.tolist() for p in positions]
            expected_ids = torch.stack([ref[p - 1][id_rows[j]] for j, p in enumerate(positions)])
            assert torch.allclose(sc.id_log_probs.double(), expected_ids, atol=TOLERANCE)

        manager = RolloutManager(student, tokenizer=tokenizer, reward_fn="exact_match", teacher=teacher,
                                 num_teacher_top_log_probs=2)
        prompts = [[4, 10, 11], [4, 12]]
        samples = manager.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True),
                                   n_samples_per_prompt=2, labels=["ab", "cd"])
        assert [s.group_index for s in samples] == [0, 0, 1, 1]
        assert all(s.reward == float(s.response_text.strip() == s.label) for s in samples)
        refs = trainer_log_probs(tiny_checkpoints[1], single_process_world, [s.tokens for s in samples])
        for s, ref in zip(samples, refs):
            P = len(s.prompt_ids)
            expected = [ref[P - 1 + j, t].item() for j, t in enumerate(s.response_ids)]
            assert s.teacher_log_probs == pytest.approx(expected, abs=TOLERANCE)
            assert all(lp <= 0 and lp != TEACHER_EXECUTED_SENTINEL for lp in s.teacher_log_probs)
        batch = StepBatch.from_samples(samples)
        assert [t.numel() for t in batch["teacher_log_probs"]] == batch["response_lengths"] == [4, 4, 4, 4]
        assert batch["teacher_top_ids"][0].shape == (4, 2)
