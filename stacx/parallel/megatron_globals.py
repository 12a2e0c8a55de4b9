"""Put megatron-core's module-level state back as a fresh process has it (a role worker reused by another run).

megatron-core keeps run state in module globals besides its process groups: the model-parallel RNG tracker
(`tensor_parallel.random`), the global micro-batch calculator, the MoE layer-wise loss tracker, the rerun state
machine, and, in `parallel_state`, the global memory buffers and the virtual-pipeline rank and size. A process
that trained one run and builds the next must start from none of them, or the second run could read the first
one's (a forked RNG state, a micro-batch count, an auxiliary-loss sum). `reset_megatron_globals` sets each back
to the value it has right after import; the patches of `megatron_cpu_compat` stay (they change no state).
"""

from __future__ import annotations


def reset_megatron_globals() -> None:
    """Tear down megatron-core's parallel state and reset its other module globals to their import-time values.

    The default torch.distributed group is left to the caller (`groups.destroy_parallel_layout` ends both).
    """
    from stacx.parallel.megatron_import import import_megatron_core

    import_megatron_core()  # a no-op in a process that built a model
    from megatron.core import num_microbatches_calculator, parallel_state, rerun_state_machine
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils

    from stacx.parallel import megatron_cpu_compat

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # Set by `groups.with_virtual_pipeline_stages` even when no groups were built (destroy_model_parallel
    # clears them only when they were); megatron's setter of the rank is deprecated, hence the assignments.
    parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
    parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
    megatron_random._CUDA_RNG_STATE_TRACKER = None
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER.clear()
    rerun_state_machine.destroy_rerun_state_machine()
    megatron_cpu_compat.finish_pipeline_sends()
