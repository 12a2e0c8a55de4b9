"""Under torchrun every rank runs `stacx train`, but only the first drives the run: it alone reads and
checks the data in the preflight. The other ranks skip it and so never load the tokenizer
(`transformers`: seconds of CPU at the start of every rank); the first rank's failure stops them."""

from __future__ import annotations

import pytest

import stacx.trainer.config.resolve as resolve
import stacx.trainer.preflight as preflight
from stacx.trainer.text_workload import TextDriver


@pytest.fixture
def preflight_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(preflight, "run_preflight",
                        lambda run_config, recipe, algorithm, load_data=True: calls.append(load_data))
    monkeypatch.setattr(preflight, "unread_checkpoint_flags", lambda run_config, recipe: {})
    monkeypatch.setattr(preflight, "ignored_settings", lambda run_config: [])
    monkeypatch.setattr(resolve, "resolve_algorithm_config", lambda recipe, run_config: object())
    return calls


@pytest.mark.parametrize(("rank", "reads_the_data"), [("0", True), ("1", False), ("3", False), (None, True)])
def test_only_the_first_rank_reads_the_data_in_the_preflight(monkeypatch, preflight_calls, rank, reads_the_data):
    if rank is None:  # outside torchrun (a Ray run's driver): the process drives the run
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    TextDriver(run_config=object(), recipe=object())
    assert preflight_calls == [reads_the_data]
