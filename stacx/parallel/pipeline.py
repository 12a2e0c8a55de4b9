"""Pipeline parallelism: megatron-core's schedule over Stacx's packed micro-batches, and the
two exchanges between stages that the schedule does not do.

A role with `--pipeline-model-parallel-size P` splits its layers into P stages; stage s holds
layers [s*L/P, (s+1)*L/P), the first stage also the embedding, the last the final norm and the LM
head. One train step on every rank of the pipeline:

    records = run_pipeline(model, micro_batches, stage_forward, last_stage_loss, forward_only=False)
        # megatron's 1F1B schedule: stage_forward(mb, chunk) on every stage (activations go on to the
        # next stage, their shapes first: a packed micro-batch's length varies), then on the last
        # stage last_stage_loss(output, mb) -> (loss, record); backward runs through every stage.
        # With virtual stages `model` is the rank's list of model chunks and the schedule is megatron's
        # interleaved one: each chunk runs every micro-batch, chunk c of rank r being virtual stage c*P+r.
    metrics = from_last_stage(metrics, groups)      # the last stage's metrics, on every stage
    per_stage = from_every_stage(value, groups)     # [stage 0's value, stage 1's, ...] on every stage

The loss is used as `last_stage_loss` returns it: Stacx's reducer has already normalized it by
the step's global counts (`stacx.parallel.reduction`), so the schedule must not divide it by the
micro-batch count. megatron skips that division when the config's `calculate_per_token_loss` is
set; `run_pipeline` sets it for the schedule call only, because megatron's DDP reads the same flag
when it is built and then sums gradients over DP instead of averaging them, which the reducer's
scale already assumes (`Reducer.gradient_scale`). A PP=2 step equals the PP=1 step in fp32 up to
the order in which the grad norm adds its squares (tests/parallel/test_pipeline.py).

    for name, tensor in stream_to_first_stage(local_named_tensors, groups): ...
        # every stage's tensors, in stage order, on the first stage (weight sync, Hugging Face export)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from stacx.parallel.groups import ProcessGroups
from stacx.parallel.megatron_cpu_compat import finish_pipeline_sends

#: What the schedule counts as the tokens of one micro-batch's loss; see the module docstring.
_UNSCALED = torch.tensor(1, dtype=torch.int)


def run_pipeline(
    model,
    micro_batches: Sequence[Any],
    stage_forward: Callable[[Any, Any], Any],
    last_stage_loss: Callable[[Any, Any], tuple[torch.Tensor, Any]],
    *,
    forward_only: bool,
) -> list[Any]:
    """Run megatron's pipeline schedule over `micro_batches` on this stage of `model` (a model, or the
    list of this rank's model chunks: the interleaved schedule).

    stage_forward(micro_batch, chunk) -> the output of `chunk` (the model, or the chunk the schedule runs;
    the next stage's input, or on the last stage whatever `last_stage_loss` reads).
    last_stage_loss(output, micro_batch) -> (loss, record), on the last stage only. Returns the records in
    micro-batch order on the last stage, [] elsewhere. Collective over the pipeline group: every stage
    must pass the same number of micro-batches (with chunks, a multiple of the pipeline size: megatron's
    interleaved schedule runs them in groups of P).
    """
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("run_pipeline got no micro-batches")
    records: list[Any] = []

    def forward_step(data_iterator, model_chunk):
        micro_batch = next(data_iterator)
        output = stage_forward(micro_batch, model_chunk)

        def loss_func(last_stage_output):
            loss, record = last_stage_loss(last_stage_output, micro_batch)
            records.append(record)
            return loss, _UNSCALED, {}

        return output, loss_func

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    # Every chunk reads every micro-batch, from an iterator of its own.
    data = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    schedule = get_forward_backward_func()
    config = chunks[0].config  # the chunks share one TransformerConfig
    divides_loss = config.calculate_per_token_loss
    config.calculate_per_token_loss = True  # see the module docstring
    try:
        # seq_length / micro_batch_size only size the activations of fixed-length runs; with
        # variable_seq_lengths each micro-batch's shape travels with it.
        schedule(forward_step_func=forward_step, data_iterator=data, model=chunks,
                 num_microbatches=len(micro_batches), seq_length=1, micro_batch_size=1, forward_only=forward_only)
    finally:
        config.calculate_per_token_loss = divides_loss
    finish_pipeline_sends()  # over gloo the last sends may still be in flight (megatron_cpu_compat, patch 9)
    return records


def from_last_stage(value: Any, groups: ProcessGroups) -> Any:
    """The last stage's `value` (any picklable object) on every stage of the pipeline group."""
    if groups.pp_size == 1:
        return value
    holder = [value if groups.is_last_stage else None]
    dist.broadcast_object_list(holder, group_src=groups.pp_size - 1, group=groups.pp)
    return holder[0]


def from_every_stage(value: Any, groups: ProcessGroups) -> list[Any]:
    """Every stage's `value` (any picklable object), in stage order, on every stage of the pipeline group."""
    if groups.pp_size == 1:
        return [value]
    values = [None] * groups.pp_size
    dist.all_gather_object(values, value, group=groups.pp)
    return values


def stream_to_first_stage(named_tensors: Iterable[tuple[str, torch.Tensor]], groups: ProcessGroups
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's (name, tensor) pairs on the first stage: its own, then stage 1's, 2's, ...,
    one tensor at a time (point to point, so memory holds one tensor of another stage at once).

    On the other stages this sends its pairs to the first stage and yields nothing; every stage
    must exhaust the iterator. Without PP it yields `named_tensors` unchanged.
    """
    if groups.pp_size == 1:
        yield from named_tensors
        return
    first = dist.get_global_rank(groups.pp, 0)
    if groups.pp_rank != 0:
        for name, tensor in named_tensors:
            tensor = tensor.contiguous()
            dist.send_object_list([(name, tuple(tensor.shape), tensor.dtype)], dst=first, group=groups.pp)
            dist.send(tensor, dst=first, group=groups.pp)
        dist.send_object_list([None], dst=first, group=groups.pp)
        return
    yield from named_tensors
    for stage in range(1, groups.pp_size):
        source = dist.get_global_rank(groups.pp, stage)
        while True:
            header = [None]
            dist.recv_object_list(header, src=source, group=groups.pp)
            if header[0] is None:
                break
            name, shape, dtype = header[0]
            tensor = torch.empty(shape, dtype=dtype)
            dist.recv(tensor, src=source, group=groups.pp)
            yield name, tensor
