"""`STACX_*` overrides are read once, where the run is resolved, and every rank receives the result
(issue 13, item 1): a Ray worker whose own environment says otherwise still trains with the
driver's values, and the driver's own decisions (teacher top-K) use them too."""

from __future__ import annotations

import dataclasses

import pytest

from stacx.env_overrides import ENV_OVERRIDES
from stacx.trainer.cluster.ray.graph import WorkerLayout, create_role_workers
from stacx.trainer.factory import resolve_recipe
from stacx.trainer.recipes import get_recipe
from stacx.trainer.config.resolve import apply_run_env_overrides
from stacx.trainer.config.run import RunConfig

#: A non-default value per variable for the driver, and a conflicting one in the workers' environment.
DRIVER_VALUES = {"STACX_DISTILL_KL_MODE": "topk", "STACX_DAGGER_SAMPLING_MODE": "kappa", "STACX_DAGGER_SFT_MODE": "trajectory"}
WORKER_VALUES = {"STACX_DISTILL_KL_MODE": "k3_sample", "STACX_DAGGER_SAMPLING_MODE": "beta", "STACX_DAGGER_SFT_MODE": "live"}


def worker_resolution(worker, run_config, algorithm) -> dict:
    """What a worker trains with: the teacher section and algorithm it received, and the
    distillation mode its specialization picks (runs in the Ray worker)."""
    import os

    from stacx.specializations.distill import DistillSpecialization

    return {"teacher": dataclasses.asdict(run_config.teacher), "algorithm": algorithm.to_dict(),
            "distill_kl_mode": DistillSpecialization(algorithm).kl_mode,
            "own_env": {name: os.environ.get(name) for name in WORKER_VALUES}}


def driver_resolution(run_config, environ) -> tuple:
    from stacx.specializations.distill import DistillSpecialization

    resolved = apply_run_env_overrides(run_config, environ)
    _, algorithm = resolve_recipe(resolved)
    return resolved, algorithm, DistillSpecialization(algorithm).kl_mode


def test_every_variable_is_covered():
    assert set(DRIVER_VALUES) == set(WORKER_VALUES) == set(ENV_OVERRIDES)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_driver_and_a_ray_worker_resolve_the_same_configuration_under_each_stacx_variable(monkeypatch, ray_address):
    base = RunConfig.from_dict({"train": {"algorithm": "opd"}, "teacher_url": "http://127.0.0.1:1"})
    graph = None
    try:
        graph = create_role_workers(get_recipe("opd"), WorkerLayout(num_cpus_per_rank=1.0, call_timeout_s=300.0,
                                                                     worker_env_vars=WORKER_VALUES))
        workers = graph.workers["policy"]
        for variable, value in DRIVER_VALUES.items():
            environ = {variable: value}
            for name in DRIVER_VALUES:
                monkeypatch.delenv(name, raising=False)
            monkeypatch.setenv(variable, value)
            resolved, algorithm, driver_mode = driver_resolution(base, environ)
            field_name = ENV_OVERRIDES[variable][0]
            assert getattr(resolved.teacher, field_name) == value, variable  # the driver applied it
            (seen,) = workers.execute_all(worker_resolution, resolved, algorithm)
            assert seen["own_env"][variable] == WORKER_VALUES[variable]  # the worker's env disagrees...
            assert seen["teacher"] == dataclasses.asdict(resolved.teacher), variable  # ...yet it sees the driver's
            assert seen["algorithm"] == algorithm.to_dict(), variable
            assert seen["distill_kl_mode"] == driver_mode, variable
            if variable == "STACX_DISTILL_KL_MODE":
                # The driver's teacher top-K request reads the same resolved section.
                assert resolved.teacher.distill_kl_mode == algorithm.distill_kl_mode == "topk"
    finally:
        if graph is not None:
            graph.shutdown()
