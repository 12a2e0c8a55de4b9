"""How an update's buckets are numbered and staged: `numbered_buckets` (the one numbering every HTTP engine
client sends by) and `MappedStagingFile`, the growing same-host staging file of `stacx serve`'s and vLLM's
clients. No server."""

import os
import tempfile

import pytest
import torch

from stacx.parallel.tensor_buckets import unpack_bucket
from stacx.wire.weight_transfer import (
    SHM_FILE_PREFIX,
    SharedMemoryStaging,
    numbered_buckets,
    shared_memory_directory,
    validate_bucket_header,
)


def test_buckets_are_numbered_in_order_and_only_the_last_is_final():
    produced = []

    def buckets():
        for name in "abc":
            produced.append(name)
            yield [(name, torch.zeros(1))]

    seen = []
    for index, bucket, final in numbered_buckets(buckets()):
        seen.append((index, bucket[0][0], final, len(produced)))
    # each bucket is handed on once the next one is produced (so only the true last one is final)
    assert seen == [(0, "a", False, 2), (1, "b", False, 3), (2, "c", True, 3)]
    assert list(numbered_buckets([[("only", torch.zeros(1))]]))[0][::2] == (0, True)
    with pytest.raises(ValueError, match="update_weights: no buckets given"):
        list(numbered_buckets(iter(())))


def _read_back(header, path):
    flat = validate_bucket_header(header, os.path.getsize(path), where="test")
    data = torch.from_file(path, shared=False, size=header["num_bytes"], dtype=torch.uint8)
    return unpack_bucket(data, flat.slots)


def test_the_staging_file_grows_for_a_larger_bucket_and_holds_each_bucket_as_sent():
    handle, path = tempfile.mkstemp(prefix=SHM_FILE_PREFIX + "test-", dir=shared_memory_directory())
    os.close(handle)
    staging = SharedMemoryStaging(path, "staging-id")
    try:
        small = [("w", torch.arange(4, dtype=torch.float32))]
        large = [("w", torch.arange(64, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.bfloat16))]
        header = staging.write(small, version=1, final=False, index=0)
        assert header["staging_id"] == "staging-id" and (header["bucket"], header["final"]) == (0, False)
        assert torch.equal(_read_back(header, path)["w"], small[0][1])
        first_capacity = staging.capacity
        header = staging.write(large, version=1, final=True, index=1)
        grown = staging.capacity
        assert grown > first_capacity and os.path.getsize(path) >= header["num_bytes"]
        back = _read_back(header, path)
        assert torch.equal(back["w"], large[0][1]) and torch.equal(back["b"], large[1][1])
        header = staging.write(small, version=2, final=True)  # a smaller bucket reuses the larger file
        assert staging.capacity == grown and os.path.getsize(path) == grown
        assert torch.equal(_read_back(header, path)["w"], small[0][1])
    finally:
        staging.close()
    assert not os.path.exists(path)
