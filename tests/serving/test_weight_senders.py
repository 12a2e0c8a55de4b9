"""Two runs pushing to one `stacx serve` (stacx.wire.weight_versions: every bucket names its sender).

The case behind a WeightSyncMismatch on every adapted weight: a second run attached (`--rollout-urls`) to a server
that an earlier run had pushed LoRA adapters to. An adapter push fits in one bucket, so the second run's first
push (version 1, bucket 0, final) was refused as not newer (409), and its client took the 409 for a retry of its
own bucket that had landed, because the server's last accepted bucket was also version 1, bucket 0 (the earlier
run's). The push was skipped silently, the earlier run's adapters stayed served, and only the post-sync check saw
it. Now the 409 carries the last bucket's sender, another sender's bucket is never taken for one's own, and the
second run's push fails at once, naming the cause and the fix; a client's own retry is still taken as done.
"""

from __future__ import annotations

import pytest
import torch

from stacx.wire.weight_versions import is_own_accepted_bucket

KEY = "weight-senders-test-key"


@pytest.fixture(scope="module")
def adapter_engine(tmp_path_factory):
    """A CPU engine that takes adapter-only pushes (as `stacx serve --lora-rank 4 --lora-alpha 8`), and the
    names and shapes of the adapters it takes (one bucket, as a run's adapter push)."""
    from stacx.models import iter_hf_weight_buckets
    from stacx.models.lora import LoraSettings
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout

    path = str(tmp_path_factory.mktemp("senders") / "qwen3")
    save_tiny_hf_checkpoint(path, "qwen3", seed=0)
    engine = CpuEngine.from_hf_checkpoint(path, lora=LoraSettings(rank=4, alpha=8.0))
    groups = ensure_single_process_layout()
    template = [(name, tensor.clone()) for bucket in iter_hf_weight_buckets(engine.model, groups, 1 << 24,
                                                                            adapters=True) for name, tensor in bucket]
    return engine, template


def _adapters(template, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(tensor.shape, generator=generator) * 0.1) for name, tensor in template]


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_a_second_run_on_a_server_another_run_pushed_to_is_refused_not_skipped(adapter_engine, transport):
    from stacx.rollout.engines.http import HttpEngine
    from stacx.rollout.weight_check import DigestingBuckets, verify_engine_weights
    from stacx.serving.server import EngineHttpServer
    from stacx.wire.http_client import RetryPolicy, ServerRequestError

    engine, template = adapter_engine
    start = engine.weight_version()
    with EngineHttpServer(engine, api_key=KEY) as server:
        first, second = (HttpEngine(server.url, api_key=KEY, weight_transport=transport,
                                    retry=RetryPolicy(max_attempts=1)) for _ in range(2))
        # the earlier run: its adapters at its version start + 1, checked
        sent = DigestingBuckets([_adapters(template, seed=1)], dtype=torch.float32)
        first.update_weights(sent, version=start + 1)
        assert verify_engine_weights(first, sent.digests, url=server.url, version=start + 1)["unverified"] == 0
        # the second run's push of the same version, bucket and final flag (other adapters) is refused at once
        with pytest.raises(ServerRequestError, match=r"HTTP 409.*pushed by another sender.*restart `stacx serve`"):
            second.update_weights([_adapters(template, seed=2)], version=start + 1)
        assert engine.weight_version() == start + 1
        verify_engine_weights(second, sent.digests, url=server.url, version=start + 1)  # nothing of it was loaded
        # a client's own retried bucket that had landed is still taken as done
        retried = _adapters(template, seed=3)
        first._send_bucket(retried, version=start + 2, index=0, final=True)
        first._send_bucket(retried, version=start + 2, index=0, final=True)
        assert engine.weight_version() == start + 2
        for client in (first, second):
            client.shutdown()


def test_only_the_same_sender_owns_an_accepted_bucket():
    answer = {"last_accepted": {"version": 3, "bucket": 0, "final": True, "sender": "a1"}}
    assert is_own_accepted_bucket(answer, version=3, bucket=0, sender="a1")
    assert not is_own_accepted_bucket(answer, version=3, bucket=0, sender="b2")
    assert not is_own_accepted_bucket({"last_accepted": {"version": 3, "bucket": 0, "final": True}},
                                      version=3, bucket=0, sender="a1")  # an older server names no sender


@pytest.mark.parametrize("sender", ["", 7, "x" * 65])
def test_a_malformed_sender_is_refused_naming_the_field(sender):
    from stacx.wire.weight_transfer import validate_bucket_header

    header = {"names": [], "dtypes": [], "shapes": [], "offsets": [], "num_bytes": 0, "version": 1, "bucket": 0,
              "final": True, "sender": sender}
    with pytest.raises(ValueError, match="'sender' must be a string of 1 to 64 characters"):
        validate_bucket_header(header, 0, where="/stacx/update_weights_bucket")
