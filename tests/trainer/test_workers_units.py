"""Pieces of the Ray execution layer that need no cluster: layouts, validation, address resolution."""

from __future__ import annotations

import pytest

from stacx.specializations.base import Specialization
from stacx.trainer.config.recipe import ModelRole, TrainingConfig
from stacx.trainer.cluster.ray.graph import WorkerLayout, resolve_role_layouts
from stacx.trainer.cluster.ray.connect import connect_ray, resolve_ray_address
from stacx.trainer.recipes import TRAINING_CONFIGS
from stacx.trainer.cluster.ray.placement import ResourcePool


def test_resource_pool_validation_names_pool_and_field():
    assert ResourcePool(name="p", num_bundles=2, num_cpus_per_bundle=0.5,
                        bundle_resources=({"node_a": 1}, {"node_b": 1})).bundles() == [
        {"CPU": 0.5, "node_a": 1.0}, {"CPU": 0.5, "node_b": 1.0}]
    with pytest.raises(ValueError, match="'p'.*num_bundles"):
        ResourcePool(name="p", num_bundles=0)
    with pytest.raises(ValueError, match="bundle_resources"):
        ResourcePool(name="p", num_bundles=2, bundle_resources=({"node_a": 1},))
    with pytest.raises(ValueError, match="strategy"):
        ResourcePool(name="p", num_bundles=1, strategy="SCATTER")
    with pytest.raises(ValueError, match="CPUs or GPUs"):
        ResourcePool(name="p", num_bundles=1, num_cpus_per_bundle=0)


def test_ray_address_precedence():
    assert resolve_ray_address("10.0.0.1:6379", {"RAY_ADDRESS": "10.0.0.2:6379"}) == "10.0.0.1:6379"
    assert resolve_ray_address(None, {"RAY_ADDRESS": " 10.0.0.2:6379 "}) == "10.0.0.2:6379"
    assert resolve_ray_address("", {"RAY_ADDRESS": ""}) is None
    assert resolve_ray_address(None, {}) is None


def test_sizing_an_attached_cluster_is_an_error():
    with pytest.raises(ValueError, match="num_cpus"):
        connect_ray("10.0.0.1:6379", num_cpus=4)


def test_role_layouts_fill_each_pool():
    ppo = TRAINING_CONFIGS["ppo"]
    layouts = resolve_role_layouts(ppo, WorkerLayout(data_parallel_size=2, tensor_model_parallel_size=2))
    assert {name: (lay.tensor_model_parallel_size, lay.data_parallel_size) for name, lay in layouts.items()} == {
        "actor": (2, 2), "critic": (2, 2)}
    mixed = TrainingConfig(
        name="mixed", description="a tp=4 policy with a tp=1 frozen role on its devices", data_source="dataset",
        roles=(ModelRole(name="policy", specialization_cls=Specialization, tensor_model_parallel_size=4),
               ModelRole(name="frozen", specialization_cls=Specialization, trainable=False,
                         tensor_model_parallel_size=3, shares_pool_with="policy")),
    )
    with pytest.raises(ValueError, match="'frozen'.*tp=3"):
        resolve_role_layouts(mixed, WorkerLayout())
    with pytest.raises(ValueError, match="data_parallel_size"):
        WorkerLayout(data_parallel_size=0)


@pytest.mark.parametrize("name", sorted(TRAINING_CONFIGS))
def test_every_catalog_recipe_resolves_a_layout(name):
    config = TRAINING_CONFIGS[name]
    layouts = resolve_role_layouts(config, WorkerLayout(data_parallel_size=2))
    assert set(layouts) == {role.name for role in config.roles}
    for pool, members in config.role_graph().pools.items():
        assert len({layouts[m].world_size for m in members}) == 1, pool


def test_worker_layout_from_the_run_configs_parallel_section():
    from stacx.trainer.config.run import RunConfig

    section = RunConfig.from_dict({"tensor_model_parallel_size": 2, "data_parallel_size": 3,
                                   "collective_timeout_s": 42.0}).parallel
    layout = WorkerLayout.from_parallel_section(section, call_timeout_s=10.0)
    assert (layout.tensor_model_parallel_size, layout.data_parallel_size, layout.collective_timeout_s,
            layout.call_timeout_s) == (2, 3, 42.0, 10.0)


def test_expert_grid_goes_to_trainable_roles_and_must_divide_their_ranks():
    from stacx.trainer.config.run import RunConfig

    section = RunConfig.from_dict({"data_parallel_size": 2, "expert_model_parallel_size": 2}).parallel
    ppo = TRAINING_CONFIGS["ppo"]
    layouts = resolve_role_layouts(ppo, WorkerLayout.from_parallel_section(section))
    assert {name: (lay.expert_model_parallel_size, lay.data_parallel_size) for name, lay in layouts.items()} == {
        "actor": (2, 2), "critic": (2, 2)}
    refresh = resolve_role_layouts(TRAINING_CONFIGS["grpo_reference_refresh"],
                                   WorkerLayout(data_parallel_size=2, expert_model_parallel_size=2))
    assert refresh["reference"].expert_model_parallel_size == 1  # a frozen role keeps every expert on every rank
    with pytest.raises(ValueError, match=r"'actor' has 2 ranks.*--expert-model-parallel-size 4"):
        resolve_role_layouts(ppo, WorkerLayout(data_parallel_size=2, expert_model_parallel_size=4))
