"""Runs on warm role workers (`create_trainer(run_config, graph=graph)`): a run is refused on workers laid out
otherwise, megatron-core's module state is emptied between runs, and a run on workers that already trained
another one equals, bit for bit, the same run on fresh workers.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.trainer.training_fixtures import read_metrics, run_config

def _graph_for(recipe: str, layout):
    """A `RoleWorkerGraph` as `create_role_workers` would describe it, without starting a worker."""
    from stacx.trainer.cluster.ray.graph import RoleWorkerGraph, resolve_role_layouts
    from stacx.trainer.recipes import get_recipe

    training_config = get_recipe(recipe)
    return RoleWorkerGraph(training_config, resolve_role_layouts(training_config, layout), layout=layout)


def test_a_graph_laid_out_otherwise_is_refused_naming_the_role_both_layouts_and_the_fix():
    from stacx.trainer.cluster.ray.graph import WorkerLayout, check_graph_fits
    from stacx.trainer.recipes import get_recipe

    tp2 = WorkerLayout(tensor_model_parallel_size=2)
    graph = _graph_for("sft", tp2)
    check_graph_fits(graph, get_recipe("grpo"), tp2)  # another recipe with the same role and layout fits
    with pytest.raises(ValueError) as caught:
        check_graph_fits(graph, get_recipe("sft"), WorkerLayout())
    message = str(caught.value)
    assert "role 'policy'" in message and "tp=1" in message and "tp=2" in message
    assert "create_role_workers" in message and "graph=" in message
    with pytest.raises(ValueError, match=r"roles \['actor', 'critic'\].*roles \['policy'\]"):
        check_graph_fits(graph, get_recipe("ppo"), tp2)
    with pytest.raises(ValueError, match="'num_gpus_per_rank'"):
        check_graph_fits(graph, get_recipe("sft"), WorkerLayout(tensor_model_parallel_size=2, num_gpus_per_rank=1.0))
    graph.ended = "killed after a failed run"
    with pytest.raises(RuntimeError, match="killed after a failed run"):
        check_graph_fits(graph, get_recipe("sft"), tp2)


def test_megatron_module_state_is_back_to_its_import_time_values_after_a_reset():
    """What a run leaves in megatron-core's modules (groups, virtual-pipeline size, RNG tracker, micro-batch
    calculator, MoE loss tracker, rerun machine) is gone after `reset_megatron_globals`, as in a fresh process."""
    from megatron.core import num_microbatches_calculator, parallel_state, rerun_state_machine
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils

    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.parallel.megatron_globals import reset_megatron_globals
    from stacx.serving.cpu_engine import ensure_single_process_layout

    ensure_single_process_layout()
    try:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
        megatron_random.get_cuda_rng_tracker()  # creates the tracker
        num_microbatches_calculator.init_num_microbatches_calculator(0, None, 4, 1, 1)
        moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"] = {"values": torch.ones(2)}
        rerun_state_machine.get_rerun_state_machine()
        assert megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
        assert num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None

        reset_megatron_globals()

        assert not parallel_state.model_parallel_is_initialized()
        assert parallel_state._GLOBAL_MEMORY_BUFFER is None
        assert parallel_state.get_virtual_pipeline_model_parallel_world_size() is None
        assert megatron_random._CUDA_RNG_STATE_TRACKER is None and not megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
        assert num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None
        assert moe_utils.get_moe_layer_wise_logging_tracker() == {}
        assert rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE is None
    finally:
        destroy_parallel_layout()


def _final_weights(save: str) -> dict[str, torch.Tensor]:
    from tests.checkpointing.helpers import read_torch_dist_tensors

    steps = sorted(name for name in os.listdir(save) if name.startswith("step_"))
    return read_torch_dist_tensors(os.path.join(save, steps[-1], "roles", "policy", "model"))


def _trained_values(rows: list[dict]) -> list[dict]:
    """The metrics rows without what measures the machine (times, throughputs)."""
    return [{k: v for k, v in row.items() if "time" not in k and "per_s" not in k and "throughput" not in k}
            for row in rows]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_run_on_warm_workers_equals_the_run_on_fresh_workers_bit_for_bit(ray_address, files, tmp_path):
    """An SFT run on new worker processes, then a DPO run (another seed and learning rate, an in-worker
    reference) on the same workers, then the same SFT run again on them: the two SFT runs' metrics and final
    weights are equal bit for bit, and the graph is still running, on the same processes, afterwards. (The
    first run is the fresh one: its processes had served nothing, and a run given no graph starts its workers
    the same way, `create_role_workers`; one worker start fewer than a third, graph-less run.)"""
    from stacx.trainer.cluster.ray.graph import WorkerLayout
    from stacx.trainer.cluster.ray.role_worker import RoleWorker
    from stacx.trainer.factory import create_run_workers, create_trainer

    def sft(root):
        return run_config(str(root), train={"algorithm": "sft"}, hf_checkpoint=files["policy"],
                          prompt_data=files["sft"], save=str(root / "ckpt"), save_interval=2)

    dpo = run_config(str(tmp_path / "dpo"), train={"algorithm": "dpo", "seed": 5}, lr=5e-3,
                     hf_checkpoint=files["policy"], ref_load=files["teacher"], prompt_data=files["dpo"])
    graph = create_run_workers(sft(tmp_path / "fresh"))
    try:
        assert graph.layout == WorkerLayout.from_parallel_section(dpo.parallel)
        pid = graph.workers["policy"].execute_all(RoleWorker.placement_info)[0]["pid"]
        create_trainer(sft(tmp_path / "fresh"), graph=graph).run()
        create_trainer(dpo, graph=graph).run()
        assert read_metrics(str(tmp_path / "dpo" / "out"))[-1]["policy/loss"] > 0
        create_trainer(sft(tmp_path / "warm"), graph=graph).run()
        # The graph stays open, on the same process, emptied of the run's model.
        assert graph.workers["policy"].execute_all(RoleWorker.placement_info)[0]["pid"] == pid
        assert graph.ended is None
        assert graph.workers["policy"].execute_all(lambda worker: sorted(worker.state)) == [[]]
    finally:
        graph.shutdown()

    warm_rows, fresh_rows = read_metrics(str(tmp_path / "warm" / "out")), read_metrics(str(tmp_path / "fresh" / "out"))
    assert [row["step"] for row in warm_rows] == [0, 1]
    assert _trained_values(warm_rows) == _trained_values(fresh_rows)
    assert warm_rows[-1]["policy/loss"] > 0
    warm, fresh = _final_weights(str(tmp_path / "warm" / "ckpt")), _final_weights(str(tmp_path / "fresh" / "ckpt"))
    assert warm.keys() == fresh.keys()
    for name in warm:
        assert torch.equal(warm[name], fresh[name]), name


def test_run_training_refuses_running_workers_with_restarts_before_anything_starts(tmp_path):
    """A failed run kills the graph's workers, so a restart (--max-restarts) would have none: refused up front."""
    from stacx.trainer import run_training

    with pytest.raises(ValueError, match="--max-restarts"):
        run_training(run_config(str(tmp_path), train={"algorithm": "sft"}, max_restarts=1), graph=object())
