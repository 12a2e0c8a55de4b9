"""The torchrun launcher: how a run knows torchrun started it."""

from __future__ import annotations

from stacx.trainer.spmd import launched_by_torchrun


def test_torchrun_is_detected_from_its_environment():
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert launched_by_torchrun({**base, "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"})
    assert not launched_by_torchrun(base)  # e.g. a Ray worker's variables
    assert not launched_by_torchrun({})
