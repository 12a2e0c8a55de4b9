"""Fakes of the loop's collaborators: a `RoleGroup` and a `Channel` without ranks, for building a
real `StacxTrainer` in a test (`make_trainer`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from stacx.trainer.config.layout import RankCoords, RoleLayout
from stacx.trainer.config.resolve import resolve_algorithm_config
from stacx.trainer.config.run import RunConfig
from stacx.trainer.loop import StacxTrainer
from stacx.trainer.recipes import get_recipe


class FakeRoleGroup:
    """A one-rank `RoleGroup` that records its calls; `fail_on` names a method that raises `error`."""

    def __init__(self, name: str, *, fail_on: str | None = None, error: BaseException | None = None):
        self.name = name
        self.layout = RoleLayout(tensor_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1)
        self.coords = [RankCoords(tp_rank=0, cp_rank=0, dp_rank=0)]
        self.calls: list[str] = []
        self.fail_on = fail_on
        self.error = error

    def _record(self, method: str) -> None:
        self.calls.append(method)
        if method == self.fail_on:
            raise self.error

    def train_step(self, shards, counts, norm_length) -> list[dict[str, float]]:
        self._record("train_step")
        return [{"loss": 0.0}]

    def compute_fields(self, shards, names) -> list:
        self._record("compute_fields")
        return [None]

    def push_weights(self, engine_kind, url, version, bucket_bytes, api_key, check_weights=False) -> list[int]:
        self._record("push_weights")
        return [0]

    def save(self, staging_dir) -> list:
        self._record("save")
        return []

    def load(self, loaded) -> None:
        self._record("load")

    def export_hf(self, out_dir) -> None:
        self._record("export_hf")

    def load_start_weights(self, path) -> None:
        self._record("load_start_weights")


class DriverChannel:
    """The one process of a run (as on Ray)."""

    is_driver = True

    def share(self, value: Any) -> Any:
        return value

    def barrier(self) -> None:
        pass


class FakeDataSource:
    """A dataset whose every batch is `batch` (a `StepBatch`)."""

    kind = "dataset"

    def __init__(self, batch):
        self.batch = batch

    def next_dataset_batch(self):
        return self.batch

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def make_trainer(recipe: str = "sft", *, roles: dict | None = None, rollout=None, run_config: RunConfig | None = None,
                 on_failure: Callable[[], None] = lambda: None, on_close: Callable[[], None] = lambda: None,
                 role_names: Sequence[str] | None = None, data=None) -> StacxTrainer:
    """A `StacxTrainer` of a built-in recipe over `FakeRoleGroup`s (one per role unless `roles` is given)."""
    training_config = get_recipe(recipe)
    run_config = run_config or RunConfig()
    names = role_names or [role.name for role in training_config.roles]
    roles = roles if roles is not None else {name: FakeRoleGroup(name) for name in names}
    return StacxTrainer(run_config=run_config, training_config=training_config,
                        algorithm=resolve_algorithm_config(training_config, run_config, environ={}), roles=roles,
                        channel=DriverChannel(), data=data, rollout=rollout, on_failure=on_failure, on_close=on_close)
