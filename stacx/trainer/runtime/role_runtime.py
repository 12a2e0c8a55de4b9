"""`RoleRuntime`: one rank's model for one role - build, forward-only fields, train step, weights, state.

A plain class with no Ray inside: a Ray `RoleWorker` keeps one in `worker.state["runtime"]`
(see `stacx.trainer.cluster.ray.group`), and a torchrun process (`stacx.trainer.spmd`) holds one
directly. Every method that runs a collective must be called on every rank of the role at once.

Data it receives from the driver: a list of micro-batches for this rank's DP shard (TP and CP
peers get the same list), each a `StepBatch` of those samples (stacx.trainer.batch: tokens,
response_lengths, one whole-response tensor per sample for each per-response field, DPO's
per-sequence fields). `StepBatch.pack` turns one into the `MicroBatch` a specialization reads;
the specialization slices the fields for this CP rank.

One train step (`train_step`):
    zero grads; reducer = Reducer.for_step(mode, counts)      # counts: global, from the driver
    for each micro-batch: forward_packed -> compute_loss -> backward
                          (logits, or the LM head's inputs for fused log-probs: lm_head_mode)
                          -> metric sums + loss in ONE all-reduce over DP x CP
    finish_grad_sync (one DP x CP all-reduce of the grads) -> optimizer.step -> scheduler.step
    (both skipped when the loss or the grad norm is NaN/inf: stacx.trainer.numerics)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from stacx.checkpointing.folders import load_model_weights, read_value_head_weights
from stacx.models.builder import RouterLosses, model_chunks, unwrap_model
from stacx.models.lora import (
    FROM_GRADIENT,
    LoraSettings,
    adapted_linears,
    attach_lora,
    base_weight_gradients,
    is_peft_adapter_folder,
    engine_adapter_config,
    init_a_from_gradients,
    load_peft_adapter,
)
from stacx.models.moe import (
    ExpertLoadRecorder,
    expert_load_metrics,
    is_mixture_of_experts,
    scale_router_losses_in_backward,
)
from stacx.models.value_head_names import VALUE_HEAD_NAMES
from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.parallel.groups import ProcessGroups, with_virtual_pipeline_stages
from stacx.parallel.metrics_allreduce import MetricTotals, all_reduce_metric_sums
from stacx.parallel.pipeline import from_every_stage, from_last_stage, run_pipeline
from stacx.parallel.reduction import Reducer
from stacx.rollout.engines.registry import engine_client
from stacx.rollout.weight_check import DigestingBuckets, verify_engine_weights
from stacx.specializations.base import NUM_LOSS_TOKENS, PLUGIN_METRIC_SUFFIX
from stacx.specializations.batch import MicroBatch
from stacx.trainer.batch import StepBatch
from stacx.trainer.checkpoint import capture_rng_state, restore_rng_state, write_rank_state
from stacx.trainer.config.critic_modes import critic_mode
from stacx.trainer.config.layout import RankCoords
from stacx.trainer.config.mini_batches import num_optimizer_steps
from stacx.trainer.config.recipe import ModelRole, role_checkpoint_path
from stacx.trainer.config.run import ModelSection, OptimSection, TrainSection
from stacx.trainer.numerics import WEIGHTS_NONFINITE_METRIC, step_optimizer_if_finite
from stacx.trainer.runtime.lm_head_mode import choose_lm_head_output
from stacx.trainer.runtime.optim import build_optimizer, current_lr, wrap_ddp
from stacx.trainer.runtime.value_head import attach_value_head

logger = logging.getLogger(__name__)


def lora_settings(role: ModelRole, model: ModelSection, seed: int):
    """The LoRA settings of a trainable role when --lora-rank is set, else None. A role with a value head (a
    critic) gets adapters only with --lora-critic adapters (stacx.trainer.config.critic_modes): `full` trains it
    whole, and a `frozen` critic is a frozen role of the recipe."""
    if model.lora_rank <= 0 or not role.trainable:
        return None
    if role.outputs_values and not critic_mode(model.lora_critic).adapters:
        return None
    return LoraSettings(rank=model.lora_rank, alpha=model.lora_alpha, dropout=model.lora_dropout,
                        target_modules=model.lora_target_modules, rslora=model.lora_rslora,
                        init=model.lora_init, seed=seed)

#: Fields a forward-only pass can compute (`compute_fields`).
COMPUTABLE_FIELDS = ("ref_log_probs", "log_probs", "values")
#: Key of the loss in a step's reduced metric sums (the reducer's loss_value, summed over ranks).
LOSS_METRIC = "loss"
#: The step metrics the framework logs under its own names (a specialization's metric of one of these names is
#: logged as `<name>_plugin`: set_aside_step_metric_names).
STEP_METRICS = (LOSS_METRIC, "grad_norm", "lr", "update_skipped", WEIGHTS_NONFINITE_METRIC)


def normalize_uncounted_metrics(metric_sums: dict, specialization, reducer, uncounted: set[str]) -> dict:
    """Metrics a specialization returned WITHOUT any count (no `num_loss_tokens`, no declared
    denominator), as in guide 003's `{"my_loss": reducer(loss).detach()}`, are taken as reducer
    outputs: values already normalized by the step's global counts and scaled like the loss. Each
    is divided by `reducer.gradient_scale` here, so its sum over ranks and micro-batches is the
    step's value (exactly how the logged `loss` is formed); their names are added to `uncounted`
    and logged as those sums. Metrics of a specialization that reports counts are untouched.
    """
    if NUM_LOSS_TOKENS in metric_sums:
        return metric_sums
    declared = specialization.metric_denominators
    for name, value in list(metric_sums.items()):
        if name.startswith("num_") or name in declared:
            continue
        value = value.detach().to(torch.float64) if torch.is_tensor(value) else torch.tensor(float(value), dtype=torch.float64)
        if value.numel() != 1:
            raise ValueError(f"{type(specialization).__name__}: metric {name!r} must be a scalar, got shape {tuple(value.shape)}")
        metric_sums[name] = value.reshape(()) / reducer.gradient_scale
        uncounted.add(name)
    return metric_sums


def set_aside_step_metric_names(metric_sums: dict, uncounted: set[str]) -> dict:
    """A specialization's (a plugin's) metric named like a step metric the framework logs itself (`loss`,
    `grad_norm`, `lr`, `update_skipped`, `weights_nonfinite`) is kept as `<name>_plugin`: the framework's value keeps
    the name that dashboards, plots and the finite check read, and the plugin's is logged beside it, never replaced.
    (Metrics such as `entropy` go the other way: the plugin keeps the name, see `FRAMEWORK_METRIC_SUFFIX`.)"""
    for name in STEP_METRICS:
        if name in metric_sums:
            metric_sums[name + PLUGIN_METRIC_SUFFIX] = metric_sums.pop(name)
            if name in uncounted:
                uncounted.discard(name)
                uncounted.add(name + PLUGIN_METRIC_SUFFIX)
    return metric_sums


class RoleRuntime:
    """One rank of one role: model (+ DDP, optimizer, scheduler when trainable), specialization,
    optional in-worker reference weights."""

    def __init__(self, role: ModelRole, algorithm: AlgorithmConfig, groups: ProcessGroups, *, model: ModelSection,
                 optim: OptimSection, train: TrainSection, rank: int = 0):
        """model: the run's checkpoint folders; optim: the optimizer and LR schedule of a trainable role;
        train: the seed, the step counts of the LR schedule and the LM-head log-prob mode."""
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models import build_model, padded_vocab_size
        from stacx.models.architectures import decoder_shape, load_hf_config, num_virtual_stages

        self.role = role
        self.model_section = model
        self.train_section = train
        self.groups = groups
        self.rank = rank
        path = role_checkpoint_path(role, model)
        if path is None:
            flag = "--" + role.checkpoint_arg.replace("_", "-")
            raise ValueError(f"role {role.name!r} starts from {flag}, which is not set")
        torch.manual_seed(train.seed)
        # A torch_dist folder from another framework carries no config.json: the policy's config describes it.
        config_source = path if os.path.isfile(os.path.join(path, "config.json")) else model.hf_checkpoint
        if groups.pp_size > 1:  # interleaved stages: this rank's layers in several model chunks
            num_layers = decoder_shape(load_hf_config(config_source)).num_layers
            groups = with_virtual_pipeline_stages(groups, num_virtual_stages(
                num_layers, groups.pp_size, model.num_layers_per_virtual_pipeline_stage))
            self.groups = groups
        # One GPTModel, or with virtual pipeline stages the list of this rank's chunks (`model_chunks`).
        self.model = build_model(config_source, groups, initialize_weights=False, router_losses=RouterLosses(
            aux_loss_coeff=model.moe_aux_loss_coeff, z_loss_coeff=model.moe_z_loss_coeff),
            sequence_parallel=model.sequence_parallel)
        self.mixture_of_experts = is_mixture_of_experts(self.model)
        self.reference_weights: list[torch.Tensor] | None = None
        reference_path = (
            role_checkpoint_path(role, model, role.reference_checkpoint_arg)
            if role.reference_checkpoint_arg else None
        )
        if reference_path is not None and role.outputs_values:
            raise ValueError(f"role {role.name!r} has a value head; an in-worker reference needs a language-model head")
        self.lora = lora_settings(role, model, train.seed)
        if reference_path is not None and self.lora is not None:
            reference_path = self._reference_is_the_base(reference_path, path)
        if reference_path is not None:
            # Load the reference into the one module, keep its tensors, then load the role's own weights:
            # no second model object is ever built.
            load_model_weights(self.model, reference_path, groups,
                               flag="--" + role.reference_checkpoint_arg.replace("_", "-"))
            self.reference_weights = [p.detach().clone() for p in self._reference_params()]
        flag = "--" + role.checkpoint_arg.replace("_", "-")
        load_model_weights(self.model, path, groups, flag=flag, value_head=role.outputs_values)
        # Every rank reads the head (a torch_dist read is collective); the last stage holds it.
        start_head = self._start_value_head(path, flag) if role.outputs_values else None
        if self.lora is not None:
            attach_lora(self.model, self.lora, groups)  # freezes the base weights
        self.adapters_await_gradients = self.lora is not None and self.lora.init in FROM_GRADIENT
        """--lora-init gradient: A is set from the first train step's batch (`_init_adapters_from_gradients`); off
        once set, and for a run that starts from adapters (`--load` of a PEFT folder, a resumed checkpoint)."""
        if role.outputs_values and self.model.config.sequence_parallel:
            raise ValueError(f"role {role.name!r} outputs values, whose head reads the whole sequence on every TP "
                             "rank; --sequence-parallel is not supported for it yet (leave it off)")
        if role.outputs_values and self.groups.is_last_stage:
            head = attach_value_head(model_chunks(self.model)[-1])
            if start_head is not None:
                with torch.no_grad():
                    head.weight.copy_(start_head[0])
                    head.bias.copy_(start_head[1])
        self.specialization = role.specialization_cls(algorithm, groups)
        # V_pad/tp and the device, for the per-micro-batch choice of logits or fused log-probs.
        self.vocab_local = padded_vocab_size(self._vocab_size(), groups.tp_size) // groups.tp_size
        self.on_cuda = next(model_chunks(self.model)[0].parameters()).device.type == "cuda"
        self._logged_logits_fallback = False
        self._replay_routes = True
        """Whether forwards replay a micro-batch's routed_experts (off while the reference's log-probs are computed)."""
        self.num_steps = 0
        self._engine_clients: dict[tuple[str, str], Any] = {}
        if role.trainable:
            self.ddp = wrap_ddp(self.model)
            # The LR schedule counts optimizer steps: num_steps_per_rollout x num_epochs per rollout step.
            self.optimizer, self.scheduler = build_optimizer(
                self.ddp, optim, total_steps=num_optimizer_steps(train),
                lora_plus_ratio=model.lora_plus_ratio if self.lora is not None else 1.0)
        else:
            self.ddp, self.optimizer, self.scheduler = None, None, None
            for chunk in model_chunks(self.model):
                for p in chunk.parameters():
                    p.requires_grad_(False)

    def _start_value_head(self, path: str, flag: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(weight, bias) of the value head that the critic's start folder holds, or None (the head starts at 0);
        one log line either way."""
        hidden_size = unwrap_model(model_chunks(self.model)[-1]).config.hidden_size
        dtype = unwrap_model(model_chunks(self.model)[-1]).config.params_dtype
        found = read_value_head_weights(path, hidden_size, flag=flag, dtype=dtype)
        if self.rank == 0:
            if found is None:
                logger.info("role %r: %s %s holds no value head (looked for %s, and a Stacx critic's output_layer "
                            "[1, %d]); it starts at 0, so the first values are 0", self.role.name, flag, path,
                            ", ".join(names.weight for names in VALUE_HEAD_NAMES), hidden_size)
            else:
                logger.info("role %r: value head from %s %s: %s", self.role.name, flag, path, found[2])
        return None if found is None else (found[0], found[1])

    # ---- forward ---------------------------------------------------------------------------

    @property
    def forward_module(self):
        """The module a forward runs (DDP-wrapped when trainable); with virtual pipeline stages the list of
        this rank's chunks, which only the pipeline schedule runs (one chunk per `forward`)."""
        return self.ddp if self.ddp is not None else self.model

    def _reference_params(self) -> list[torch.nn.Parameter]:
        """The decoder's parameters the reference replaces (all of the GPTModel's, before any value head)."""
        return [p for chunk in model_chunks(self.model) for p in unwrap_model(chunk).parameters()]

    def pack(self, micro_batch: StepBatch) -> MicroBatch:
        """The specialization's `MicroBatch` for one micro-batch (see the module docstring)."""
        return micro_batch.pack(self.groups)

    def _vocab_size(self) -> int:
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models import hf_config_of

        return int(hf_config_of(self.model).vocab_size)

    def lm_head_output(self, batch: MicroBatch) -> str:
        """"hidden" (fused log-probs from an LMHeadShard) or "logits" for this micro-batch: the run's
        `lm_head_log_probs` setting, the specialization's needs and the size of the logits shard."""
        if self.role.outputs_values:
            return "logits"
        mode = self.train_section.lm_head_log_probs
        allows = not self.specialization.receives_logits()
        if mode == "fused" and not allows and not self._logged_logits_fallback:
            self._logged_logits_fallback = True
            logger.info("role %r: --lm-head-log-probs fused, but %s needs the logits; it gets them",
                        self.role.name, type(self.specialization).__name__)
        return choose_lm_head_output(mode, specialization_allows=allows, on_cuda=self.on_cuda,
                                     num_local_tokens=batch.layout.num_local_tokens, vocab_local=self.vocab_local)

    def forward(self, batch: MicroBatch, chunk=None):
        """TP-local logits [T_local, V_pad/tp] (fp32), or the LM head's inputs (`LMHeadShard`) when
        `lm_head_output` picks fused log-probs, or values [T_local] for a value-head role. `chunk`: the model
        chunk the pipeline schedule runs (default: `forward_module`).

        A micro-batch that carries `routed_experts` (--use-routing-replay) is routed as the rollout
        engine routed it, except while `compute_fields` computes the reference's log-probs (another
        model, which routes itself) and in a role with a value head (a critic)."""
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models import forward_packed

        module = self.forward_module if chunk is None else chunk
        holds_head = unwrap_model(module).post_process
        tokens_local, padded_lengths = batch.model_inputs()
        with self._routing(batch, module):
            output = forward_packed(module, tokens_local, padded_lengths, self.groups,
                                    lm_head=self.lm_head_output(batch) if holds_head else "logits")
        if not holds_head:
            return output  # hidden states for the next pipeline stage
        return output[:, 0] if self.role.outputs_values else output

    def _routing(self, batch: MicroBatch, module):
        """The context a forward of `module` runs in: the rollout's routes replayed, or the model's own routing."""
        if batch.routed_experts is None or not self._replay_routes or self.role.outputs_values:
            return contextlib.nullcontext()
        if not self.mixture_of_experts:
            raise ValueError(f"role {self.role.name!r}: the micro-batch carries routed_experts but the model is dense; "
                             "drop --use-routing-replay")
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models.routing_replay import routes_replayed

        return routes_replayed(module, batch.model_routes(), tp_rank=self.groups.tp_rank,
                               tp_size=self.groups.tp_size)

    def _reference_is_the_base(self, reference_path: str, path: str) -> None:
        """With LoRA the reference is the base model, the adapters switched off (no second copy of the weights):
        None (nothing to load), or ValueError when the reference's flag names other weights."""
        if os.path.realpath(reference_path) != os.path.realpath(path):
            flag = "--" + self.role.reference_checkpoint_arg.replace("_", "-")
            raise ValueError(f"role {self.role.name!r} trains LoRA adapters (--lora-rank {self.lora.rank}); its "
                             f"reference is the base model with the adapters off, but {flag} names other weights "
                             f"({reference_path}); drop {flag} or point it at {path}")
        self.reference_is_base = True
        return None

    reference_is_base = False
    """True with LoRA and a reference: `swap_reference` switches the adapters off and on."""

    def swap_reference(self) -> None:
        """Exchange the module's weights with the held reference weights (call twice to undo).

        Swapping `.data` moves no bytes and keeps the Parameter objects the optimizer holds. With LoRA the
        reference is the base model: the swap switches the adapters off (and on again).
        """
        if self.reference_is_base:
            for module in adapted_linears(self.model):
                module.lora_enabled = not module.lora_enabled
            return
        if self.reference_weights is None:
            flag = "--" + (self.role.reference_checkpoint_arg or "ref_load").replace("_", "-")
            raise ValueError(f"role {self.role.name!r} holds no reference model; set {flag}")
        for param, held in zip(self._reference_params(), self.reference_weights):
            param.data, held.data = held.data, param.data

    @torch.no_grad()
    def compute_fields(self, micro_batches: Sequence[StepBatch], names: Sequence[str]) -> list[dict] | None:
        """Forward-only per-sample fields for each micro-batch: {name: [whole-response tensor per sample]}.

        names: ref_log_probs (reference weights swapped in; a frozen role without them uses its own
        weights), log_probs (pi_old: current weights), values (value-head roles). Every rank computes (TP/CP collectives inside); only
        the rank with tp_rank == cp_rank == 0 returns the values (None elsewhere: peers hold copies).
        """
        unknown = [n for n in names if n not in COMPUTABLE_FIELDS]
        if unknown:
            raise ValueError(f"role {self.role.name!r}: cannot compute fields {unknown}; known: {list(COMPUTABLE_FIELDS)}")
        for chunk in model_chunks(self.forward_module):
            chunk.eval()
        results = [dict() for _ in micro_batches]

        def fields_of(output, batch, name):
            if name == "values":
                if not self.role.outputs_values:
                    raise ValueError(f"role {self.role.name!r} has no value head; it cannot compute 'values'")
                values = self.specialization.compute_values(output, batch)
            else:
                values = self.specialization.compute_log_probs(output, batch)
            return [v.detach().float().cpu() for v in values]

        for name in names:
            # Only pi_old replays the rollout's routes: the reference (and a critic) is another model, which
            # routes itself (docs/models.md, "Routing replay").
            # A frozen role without an in-worker reference is itself a reference model (e.g. a `reference`
            # role refreshed from the policy by an exchange sync): its own log-probs are the reference's.
            swapped = name == "ref_log_probs" and (self.role.trainable or self.reference_weights is not None)
            if swapped:
                self.swap_reference()
            self._replay_routes = name == "log_probs"
            try:
                if self.groups.pp_size > 1:
                    # The fields come out of the last stage; the schedule passes activations along.
                    def last_stage_fields(output, batch, name=name):
                        return output.new_zeros(()), fields_of(output, batch, name)

                    per_batch = run_pipeline(self.forward_module, [self.pack(mb) for mb in micro_batches],
                                             self.forward, last_stage_fields, forward_only=True)
                    for index, values in enumerate(per_batch):
                        results[index][name] = values
                else:
                    for index, micro_batch in enumerate(micro_batches):
                        batch = self.pack(micro_batch)
                        results[index][name] = fields_of(self.forward(batch), batch, name)
            finally:
                self._replay_routes = True
                if swapped:
                    self.swap_reference()
        holds_results = self.groups.tp_rank == 0 and self.groups.cp_rank == 0 and self.groups.is_last_stage
        return results if holds_results else None

    # ---- training --------------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[StepBatch], counts, norm_length: float | None = None) -> dict:
        """One optimizer step over this rank's micro-batches; returns the step's reduced metrics.

        counts: `StepCounts` of the whole global batch (known before the first backward).
        Every DP rank must pass the same number of micro-batches (pack_micro_batches does).
        """
        if self.optimizer is None:
            raise RuntimeError(f"role {self.role.name!r} is frozen; it has no optimizer to step")
        if not micro_batches:
            raise ValueError(f"role {self.role.name!r} rank {self.rank}: train_step got no micro-batches")
        # Imported here: megatron-core is slow to import (start-up time).
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        ddp_chunks = model_chunks(self.ddp)
        for chunk in ddp_chunks:
            chunk.train()
        reducer = Reducer.for_step(mode=self.specialization.loss_agg_mode(), counts=counts, groups=self.groups,
                                   norm_length=norm_length)
        batches = [self.pack(micro_batch) for micro_batch in micro_batches]
        if self.mixture_of_experts:
            reducer = self._with_routed_token_count(reducer, batches)
        if self.adapters_await_gradients:
            self._init_adapters_from_gradients(batches, reducer)
        for chunk in ddp_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        totals = MetricTotals()
        uncounted: set[str] = set()
        with self._expert_load() as load:
            self._forward_backward(batches, reducer, totals, uncounted)
            if self.groups.pp_size > 1:
                # Grad sync over DP x CP, plus the tied embedding's grads between the first and last stage.
                finalize_model_grads(ddp_chunks)
                # The metrics (and the loss the finite check reads) exist on the last stage only.
                totals.sums, uncounted = from_last_stage((totals.sums, uncounted), self.groups)
            elif self.groups.tp_size > 1:
                # Grad sync over DP x CP, plus the sum over TP of the gradients each TP rank holds only a
                # part of: qk-norm weights (each rank normalizes its own heads) and, under sequence
                # parallelism, the norms and routers (each rank sees its part of the sequence).
                finalize_model_grads([self.ddp])
            else:
                self.ddp.finish_grad_sync()
        loss_total = totals.sums.pop(LOSS_METRIC)
        # Never step on NaN/inf (megatron's fp32/bf16 step would apply it); the same decision on every rank.
        outcome = step_optimizer_if_finite(self.optimizer, loss_total)
        if outcome.applied:
            self.scheduler.step(increment=1)
        self.num_steps += 1
        metrics = self.specialization.metric_means(totals.sums)
        metrics.update({name: totals.sums[name] for name in uncounted})
        metrics.update(loss=loss_total, grad_norm=outcome.grad_norm, lr=current_lr(self.optimizer),
                       update_skipped=float(not outcome.applied))
        metrics[WEIGHTS_NONFINITE_METRIC] = float(not outcome.weights_finite)
        if load is not None:
            # Each stage routes through its own layers: the counts of every stage, in layer order.
            per_stage = from_every_stage((load.tokens_per_expert(self.groups), load.layers,
                                          load.dropped_token_slots(self.groups)), self.groups)
            metrics.update(expert_load_metrics(torch.cat([counts for counts, _, _ in per_stage]),
                                               [layer for _, layers, _ in per_stage for layer in layers],
                                               torch.cat([dropped for _, _, dropped in per_stage])))
        return metrics

    def _forward_backward(self, batches: Sequence[MicroBatch], reducer: Reducer, totals: MetricTotals,
                          uncounted: set[str]) -> None:
        """The forward and backward of a step's micro-batches (through the pipeline schedule at pp > 1): the
        gradients accumulate (not yet synced over DP x CP), the metric sums into `totals`."""

        def with_router_loss_scale(tensor, batch):
            # The tensor this stage's backward of `batch` starts from (see stacx.models.moe).
            if not self.mixture_of_experts:
                return tensor
            return scale_router_losses_in_backward(tensor, reducer.router_loss_scale(sum(batch.layout.padded_lengths)))

        def stage_forward(batch, chunk=None):
            output = self.forward(batch) if chunk is None else self.forward(batch, chunk)
            holds_head = unwrap_model(self.ddp if chunk is None else chunk).post_process
            return output if holds_head else with_router_loss_scale(output, batch)

        def micro_batch_loss(output, batch):
            loss, metric_sums = self.specialization.compute_loss(output, batch, reducer)
            metric_sums = normalize_uncounted_metrics(dict(metric_sums), self.specialization, reducer, uncounted)
            metric_sums = set_aside_step_metric_names(metric_sums, uncounted)
            metric_sums[LOSS_METRIC] = reducer.loss_value(loss)
            totals.add(all_reduce_metric_sums(metric_sums, self.groups.dp_cp))
            return with_router_loss_scale(loss, batch), None

        if self.groups.pp_size > 1:
            run_pipeline(self.ddp, batches, stage_forward, micro_batch_loss, forward_only=False)
        else:
            for batch in batches:
                loss, _ = micro_batch_loss(stage_forward(batch), batch)
                loss.backward()

    def _init_adapters_from_gradients(self, batches: Sequence[MicroBatch], reducer: Reducer) -> None:
        """--lora-init gradient: one forward and backward of the first step's micro-batches with the adapted
        linears' base weights taking gradients, then every A from them (`init_a_from_gradients`), B zero. The
        adapters' own gradients of this pass are dropped (the step zeroes the DDP buffers after it), and megatron's
        fp32 main copies of the adapters (bf16 training) are refreshed."""
        with base_weight_gradients(self.model):
            self._forward_backward(batches, reducer, MetricTotals(), set())
            from_gradient = init_a_from_gradients(self.model, self.lora, self.groups)
        self.optimizer.reload_model_params()
        self.adapters_await_gradients = False
        if self.rank == 0:
            logger.info("role %r: --lora-init %s: %d of rank 0's %d adapters' A from the first batch's base-weight "
                        "gradients (the rest had none: no token reached the expert; they keep a random A)",
                        self.role.name, self.lora.init, from_gradient, len(adapted_linears(self.model)))

    def _with_routed_token_count(self, reducer: Reducer, batches) -> Reducer:
        """The reducer with StepCounts.num_routed_tokens: every packed position of the step, over the DP ranks
        (one all-reduce; CP peers hold the same sequences)."""
        local = torch.tensor([float(sum(sum(batch.layout.padded_lengths) for batch in batches))], dtype=torch.float64)
        if self.groups.dp is not None and self.groups.dp_size > 1:
            dist.all_reduce(local, group=self.groups.dp)
        counts = dataclasses.replace(reducer.counts, num_routed_tokens=int(local.item()))
        return dataclasses.replace(reducer, counts=counts)

    def _expert_load(self):
        """Counts tokens per expert for a mixture-of-experts model (else records nothing)."""
        return ExpertLoadRecorder(self.model) if self.mixture_of_experts else contextlib.nullcontext()

    # ---- weights ---------------------------------------------------------------------------

    def weight_buckets(self, bucket_bytes: int, *, only_to_tp_rank: int | None = 0) -> Iterator[list]:
        """Hugging Face-named full tensors in buckets (every TP rank of the model must iterate)."""
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models import iter_hf_weight_buckets

        # --lora-sync adapters: the engine merges the adapters itself; they are all that changes.
        adapters = self.lora is not None and self.model_section.lora_sync == "adapters"
        return iter_hf_weight_buckets(self.model, self.groups, bucket_bytes, only_to_tp_rank=only_to_tp_rank,
                                      adapters=adapters)

    def push_weights_to_engine(self, engine_kind: str, url: str, version: int, bucket_bytes: int,
                               api_key: str | None = None, *, check_weights: bool = False,
                               weight_transfer: str | None = None) -> int:
        """Stream this role's weights to an inference server: ranks with cp = dp = 0 gather over TP,
        TP rank 0 sends the buckets (the driver pauses, flushes and checks the version around this). With
        experts spread over ep > 1 every rank takes part in the gathers (each holds experts the sender's
        TP group lacks), so the sender streams every expert under its Hugging Face name.
        check_weights: after the push, compare the engine's digest of every tensor with the sent one
        (stacx.rollout.weight_check: a mismatch raises WeightSyncMismatch naming the tensor). weight_transfer: how
        the sender's client sends, for a kind that offers a choice (vLLM: --vllm-weight-transfer, e.g. 'nccl':
        this rank alone joins the server's weight-transfer group and broadcasts the gathered tensors).
        Returns the number of tensors sent (0 on ranks that do not send)."""
        sender_group = self.groups.cp_rank == 0 and self.groups.dp_rank == 0
        if not sender_group and self.groups.ep_size == 1:
            return 0
        buckets = self.weight_buckets(bucket_bytes)
        if not sender_group or self.groups.tp_rank != 0 or self.groups.pp_rank != 0:
            for _ in buckets:  # take part in the TP (and expert) gathers; send this stage's tensors to the first
                pass
            return 0

        key = (engine_kind, url)
        if key not in self._engine_clients:
            options = {} if weight_transfer is None else {"weight_transfer": weight_transfer}
            self._engine_clients[key] = engine_client(engine_kind, url, api_key=api_key, **options)
            use_lora_config = getattr(self._engine_clients[key], "use_lora_config", None)
            if use_lora_config is not None and self.lora is not None and self.model_section.lora_sync == "adapters":
                # an engine that loads PEFT adapter folders (vLLM, SGLang) is told the adapters' settings
                use_lora_config(engine_adapter_config(self.lora))
        sent = [0]
        gathers_failed = [False]

        def counted():
            iterator = iter(buckets)
            while True:
                try:
                    bucket = next(iterator)
                except StopIteration:
                    return
                except BaseException:
                    gathers_failed[0] = True  # a collective broke: nothing left to match
                    raise
                sent[0] += len(bucket)
                yield bucket

        client = self._engine_clients[key]
        try:
            if not check_weights:
                client.update_weights(counted(), version=version)
                return sent[0]
            digest_dtype = getattr(client, "weight_digest_dtype", None)
            digesting = DigestingBuckets(counted(), dtype=digest_dtype() if digest_dtype is not None else None)
            client.update_weights(digesting, version=version)
        except BaseException as err:
            if isinstance(err, Exception) and not gathers_failed[0]:
                for _ in buckets:  # the engine failed, the other ranks' gathers go on: match them (a retry needs them)
                    pass
            # a retried push (stacx.rollout.engine_health) may reach a restarted server: a fresh client
            # opens a fresh shared-memory staging file there
            stale = self._engine_clients.pop(key)
            try:
                stale.shutdown()
            except Exception:  # noqa: BLE001 - the push's own error is the one reported
                pass
            raise
        verify_engine_weights(client, digesting.digests, url=url, version=version)
        return sent[0]

    def export_hf(self, out_dir: str) -> None:
        """Write the role's model as a Hugging Face checkpoint with the tokenizer of the checkpoint
        it started from (every rank calls; rank 0 writes)."""
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models import export_hf_checkpoint

        if self.role.outputs_values:
            raise ValueError(f"role {self.role.name!r} has a value head; it has no Hugging Face causal-LM export")
        export_hf_checkpoint(self.model, out_dir, self.groups,
                             tokenizer_from=role_checkpoint_path(self.role, self.model_section))

    # ---- checkpoint state ------------------------------------------------------------------

    def coords(self) -> RankCoords:
        return RankCoords.of(self.groups)

    def state_dict(self) -> dict[str, Any]:
        """This rank's small state: scheduler, RNG and step count. The weights and optimizer state are
        saved apart, in the role's torch_dist folder (`save_rank_state`); the in-worker reference is
        frozen and read again from its flag when the run resumes."""
        state: dict[str, Any] = {"rng": capture_rng_state(), "num_steps": self.num_steps}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.scheduler is not None:
            if "scheduler" not in state:
                raise ValueError(f"role {self.role.name!r}: checkpoint holds no scheduler state")
            self.scheduler.load_state_dict(state["scheduler"])
        self.num_steps = int(state.get("num_steps", 0))
        restore_rng_state(state["rng"])

    def save_rank_state(self, staging_dir: str, role_name: str, rank: int):
        """Write this rank's state into a checkpoint staging folder (the weights and optimizer state in one
        torch_dist save with the role's other ranks); returns its RankFileInfo."""
        return write_rank_state(staging_dir, role_name, rank, self.state_dict(), self.coords(),
                                model=self.model, optimizer=self.optimizer, groups=self.groups)

    def load_start_weights(self, path: str) -> None:
        """Replace the role's weights with those of model folder `path` (Hugging Face or torch_dist,
        detected; `--load` naming a model rather than a training checkpoint), or with --lora-rank the adapters of a
        PEFT adapter folder (on the run's base model). Collective."""
        if is_peft_adapter_folder(path):
            if self.lora is None:
                raise ValueError(f"--load {path}: a PEFT adapter folder; set --lora-rank (and --lora-alpha, "
                                 "--lora-target-modules) to the adapter's to start from it")
            load_peft_adapter(self.model, path, self.groups, self.lora)
            self.adapters_await_gradients = False  # the run starts from the folder's adapters
        else:
            load_model_weights(self.model, path, self.groups, flag="--load")
        if self.optimizer is not None:
            self.optimizer.reload_model_params()  # megatron's fp32 main copies of bf16 parameters follow the load

    def load_rank_state(self, loaded, role_name: str, rank: int) -> None:
        """Load this rank's state from a `LoadedCheckpoint`: weights and optimizer state resharded to this
        run's layout, then the small state (`LoadedCheckpoint.rank_state`)."""
        # Imported here: megatron-core's dist checkpointing is slow to import (start-up time).
        from stacx.checkpointing.torch_dist import load_torch_dist

        optimizer_loaded = load_torch_dist(loaded.model_folder(role_name), self.model, self.optimizer,
                                           what=f"checkpoint of role {role_name!r} in")
        if self.optimizer is not None and not optimizer_loaded:
            logger.warning("role %r: checkpoint %s holds no optimizer state; the optimizer starts afresh",
                           role_name, loaded.path)
        self.load_state_dict(loaded.rank_state(role_name, rank, self.coords()))
        self.adapters_await_gradients = False  # a resumed run keeps its trained adapters

    def close(self) -> None:
        for client in self._engine_clients.values():
            client.shutdown()
        self._engine_clients.clear()
