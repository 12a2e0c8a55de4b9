"""LoRA adapters on megatron-core's parallel linears, sharded as their base layer is.

    settings = LoraSettings(rank=8, alpha=16, target_modules=("all-linear",))
    attach_lora(model, settings, groups)      # after the base weights are loaded; freezes them
    with adapters_disabled(model): ...        # the base model (the reference of KL-regularized recipes)

An adapted linear computes y = W x + (alpha / rank) * B A dropout(x) (alpha / sqrt(rank) with `rslora`), with
A [rank, in] and B [out, rank].
Its parameters `lora_a` and `lora_b` sit on the linear itself, beside `weight` (megatron names such as
`decoder.layers.0.self_attention.linear_qkv.lora_a`), so the base names, their checkpoint keys and their
Hugging Face mappings do not change. Sharding follows the base layer's tensor-parallel group (tp, or etp for
a routed expert):

| base layer       | A                          | B                           | communication (of the [tokens, rank] tensor) |
| ---------------- | -------------------------- | --------------------------- | --------------------------------------------- |
| column-parallel  | replicated                 | split on the output dim     | copy to TP (all-reduce of its gradient); under sequence parallelism an all-gather along the sequence, A's gradient then summed over TP (`sequence_parallel` mark) |
| row-parallel     | split on the input dim     | replicated                  | all-reduce of the partial A x (the partial sums are reduced before B, an all-reduce of `rank` numbers per token instead of `out`); under sequence parallelism B x is split along the sequence afterwards |
| routed expert    | as above over etp          | as above over etp           | none at etp = 1 (etp > 1 with adapted experts is refused) |

Routed experts' adapters live with their experts (one pair per local expert; expert parallelism moves them
with the expert), and like every routed-expert parameter they are reduced over the expert-data-parallel
group (`allreduce = False`, see `stacx.trainer.runtime.optim.keep_routed_experts_apart`). Context and
pipeline parallelism need nothing: an adapter is per token and per layer.

A starts from PyTorch's default linear init drawn from a generator seeded by the run seed and the adapter's
global name (layer, module, expert), so every layout starts from the same full A; or, with `init="principal"`
(--lora-init), along the top right singular vectors of the full (gathered) base weight; or, with `init="gradient"`
(or "gradient-sign"), along those of the base weight's gradient on the first training batch (or of its sign),
which the trainer computes and sets before its first step (`base_weight_gradients`, `init_a_from_gradients`).
B starts at zero (the adapted model starts equal to the base). With `rslora` the scale is alpha / sqrt(rank) (PEFT's use_rslora).
Dropout uses the default generator, as megatron's hidden dropout: the TP ranks of a replicated input draw the
same mask.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stacx.models.weight_mapping import ADAPTER_PARAMS, is_adapter_param_name  # noqa: F401  (re-exported)
from stacx.parallel.groups import ProcessGroups
from stacx.ranges import require_in_range
from stacx.models.peft_adapters import (  # noqa: F401  (SHARED_A, peft_named_tensors re-exported)
    PEFT_CONFIG_FILE,
    PEFT_WEIGHTS_FILE,
    SHARED_A,
    hf_target_modules,
    peft_named_tensors,
)

TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts")
"""Names of `--lora-target-modules`: megatron's attention and MLP linears (a shared expert's count as the dense
MLP's), and `experts`, the routed experts' fc1 and fc2."""
ALL_LINEAR = "all-linear"
"""`--lora-target-modules all-linear`: every name of TARGET_MODULES."""

LORA_INITS = ("random", "principal", "gradient", "gradient-sign")
"""`--lora-init` values (LoraSettings.init)."""
FROM_GRADIENT = ("gradient", "gradient-sign")
"""The `--lora-init` values whose A is set from the first batch's weight gradients (`init_a_from_gradients`)."""

_COLUMN = ("linear_qkv", "linear_fc1")
_ROW = ("linear_proj", "linear_fc2")
_ROUTED_EXPERTS = ".experts.local_experts."


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """The adapters of a trainable role (run flags --lora-*)."""

    rank: int
    """--lora-rank: the rank r of each adapter (A is [r, in], B is [out, r])."""
    alpha: float
    """--lora-alpha: the update is scaled by alpha / r."""
    dropout: float = 0.0
    """--lora-dropout: dropout probability on the adapter's input (training only)."""
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    """--lora-target-modules: which linears get adapters (TARGET_MODULES, or all-linear)."""
    rslora: bool = False
    """--lora-rslora: rank-stabilized scaling, alpha / sqrt(r) instead of alpha / r (PEFT's use_rslora)."""
    init: str = "random"
    """--lora-init: how A starts (B starts at zero either way, so the adapted model starts equal to the base):
    'random' (PyTorch's default linear init), 'principal' (A's rows along the base weight's top-r right singular
    vectors, PiSSA's input subspace, at the norm of the random init's rows; the base weight is not changed),
    'gradient' (along the top-r right singular vectors of the base weight's gradient on the first training batch,
    LoRA-GA's input subspace, same norm; set by the trainer before its first step, `init_a_from_gradients`) or
    'gradient-sign' (the same of the gradient's sign: the input directions of Adam's first full fine-tuning step)."""
    seed: int = 0
    """Seed of A's initialization (the run's --seed)."""

    def __post_init__(self):
        require_in_range("--lora-rank", self.rank, at_least=1, why="to attach adapters")
        require_in_range("--lora-alpha", self.alpha, above=0)
        require_in_range("--lora-dropout", self.dropout, at_least=0, below=1)
        check_target_modules(self.target_modules)
        if self.init not in LORA_INITS:
            raise ValueError(f"--lora-init {self.init!r}: choose one of {list(LORA_INITS)}")

    @property
    def scale(self) -> float:
        """The factor of B A in the update: alpha / r, or alpha / sqrt(r) with rslora (as PEFT computes it)."""
        return self.alpha / math.sqrt(self.rank) if self.rslora else self.alpha / self.rank

    @property
    def targets(self) -> frozenset[str]:
        """The TARGET_MODULES names adapted (all-linear expanded)."""
        return frozenset(TARGET_MODULES) if ALL_LINEAR in self.target_modules else frozenset(self.target_modules)


def check_target_modules(names) -> None:
    """Raise ValueError naming --lora-target-modules for an unknown or missing name."""
    if not names:
        raise ValueError(f"--lora-target-modules needs at least one of {[*TARGET_MODULES, ALL_LINEAR]}")
    unknown = [name for name in names if name not in (*TARGET_MODULES, ALL_LINEAR)]
    if unknown:
        raise ValueError(f"--lora-target-modules: unknown module(s) {unknown}; choose from "
                         f"{[*TARGET_MODULES, ALL_LINEAR]}")


def target_of(module_name: str) -> str | None:
    """The TARGET_MODULES name of a GPTModel submodule (`decoder.layers.0.mlp.linear_fc1` -> linear_fc1;
    a routed expert's fc1 or fc2 -> experts), or None for a module no adapter goes on."""
    last = module_name.rsplit(".", 1)[-1]
    if last not in _COLUMN + _ROW:
        return None
    return "experts" if _ROUTED_EXPERTS in module_name else last


class LoraLinearMixin:
    """Mixed into the class of an adapted megatron linear (`attach_lora`): its forward adds the adapter's term."""

    lora_enabled: bool = True

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if not self.lora_enabled:
            return output, bias
        return output + self.lora_delta(input_).to(output.dtype), bias

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        # Imported here: megatron-core is slow to import (start-up time).
        from megatron.core.tensor_parallel import mappings

        if self.lora_dropout > 0.0 and self.training:
            x = F.dropout(x, p=self.lora_dropout)
        group, parallel = self.tp_group, self.tp_group.size() > 1
        sequence_parallel = parallel and self.lora_sequence_parallel
        h = F.linear(x.to(self.lora_a.dtype), self.lora_a)  # [s, b, r]
        if self.lora_kind == "column":
            if sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h, group=group)
            elif parallel:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=group)
            return F.linear(h, self.lora_b) * self.lora_scale
        if parallel:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=group)
        y = F.linear(h, self.lora_b) * self.lora_scale
        if sequence_parallel:
            y = mappings.scatter_to_sequence_parallel_region(y, group=group)
        return y

    def lora_merged_weight(self) -> torch.Tensor:
        """This rank's shard of W + scale * B A (the shard of the merged weight: B A of the local shards)."""
        return self.weight + self.lora_scale * (self.lora_b @ self.lora_a).to(self.weight.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron's, with the adapters sharded like the base weight (B on dim 0 of a column-parallel
        linear, A on dim 1 of a row-parallel one; the other replicated)."""
        # Imported here: megatron-core is slow to import (start-up time).
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {"weight": 0, "bias": 0, "lora_b": 0} if self.lora_kind == "column" else {"weight": 1, "lora_a": 1}
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


_ADAPTED_CLASSES: dict[type, type] = {}


def _adapted_class(base_cls: type) -> type:
    if base_cls not in _ADAPTED_CLASSES:
        _ADAPTED_CLASSES[base_cls] = type(f"Lora{base_cls.__name__}", (LoraLinearMixin, base_cls), {})
    return _ADAPTED_CLASSES[base_cls]


def _global_names(gpt_model) -> dict[str, str]:
    """{module name: layout-free name} of every adaptable linear: the global layer index (a pipeline stage
    numbers its layers from 0) and the global expert index (expert parallelism)."""
    names = {}
    first_expert = {name: module.local_expert_indices[0] for name, module in gpt_model.named_modules()
                    if getattr(module, "local_expert_indices", None)}
    for layer_index, layer in enumerate(gpt_model.decoder.layers):
        prefix = f"decoder.layers.{layer_index}."
        for inner, _ in layer.named_modules():
            full = prefix + inner
            if target_of(full) is None:
                continue
            name = f"layers.{int(layer.layer_number) - 1}.{inner}"
            if _ROUTED_EXPERTS in full:
                moe, rest = full.split(_ROUTED_EXPERTS)
                local, tail = rest.split(".", 1)
                name = name.split(_ROUTED_EXPERTS)[0] + f".experts.{first_expert[moe] + int(local)}.{tail}"
            names[full] = name
    return names


def _init_a(settings: LoraSettings, global_name: str, full_in: int) -> torch.Tensor:
    """The full A [rank, full_in] of one adapter: PyTorch's default linear init from a generator seeded by the
    run seed and the adapter's global name (the same on every layout)."""
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + zlib.crc32(global_name.encode()))
    bound = 1.0 / math.sqrt(full_in)  # kaiming_uniform_(a=sqrt(5)) of a [rank, full_in] weight
    return (torch.rand(settings.rank, full_in, generator=generator) * 2 - 1) * bound


def _principal_a(full_weight: torch.Tensor, rank: int, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """A [rank, in] whose rows are the top-`rank` right singular vectors of the full base weight [out, in]
    (`top_input_directions`; directions a rank-deficient weight lacks from `fallback`). A rank above min(out, in) is
    refused (no such directions)."""
    if rank > min(full_weight.shape):
        raise ValueError(f"--lora-init principal: --lora-rank {rank} exceeds the rank of a "
                         f"{tuple(full_weight.shape)} weight")
    return top_input_directions(full_weight, rank, fallback=fallback)


RELATIVE_RANK_TOLERANCE = 1e-6
"""A singular value below this times the largest counts as zero in `top_input_directions` (its vector is arbitrary)."""


def top_input_directions(matrix: torch.Tensor, rank: int, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """A [rank, in] whose rows are the top-`rank` right singular vectors of `matrix` [out, in], each at the expected
    row norm of the random init (sqrt(1/3): uniform entries of bound 1/sqrt(in)), so the adapters' step sizes, and
    the learning rates that suit them, stay those of the random init. The SVD runs in float64 and each vector's sign
    is fixed (its largest entry positive), so every layout (whose gathered matrix may order the rows differently:
    megatron's qkv and gate/up interleaving) gets the same A up to rounding.

    Directions the matrix does not have (a singular value of 0, or below RELATIVE_RANK_TOLERANCE of the largest:
    a gradient of fewer tokens than `rank`, or none) are arbitrary in an SVD, so they come from `fallback` [rank, in]
    instead (its rows made orthogonal to the directions kept, in order: the same on every layout); without a
    fallback `rank` must not exceed min(out, in)."""
    m = matrix.detach().to(dtype=torch.float64, device="cpu")
    _, s, vt = torch.linalg.svd(m, full_matrices=False)
    num_kept = int((s > s[0] * RELATIVE_RANK_TOLERANCE).sum()) if s.numel() and s[0] > 0 else 0
    top = vt[:min(rank, num_kept)]
    signs = torch.sign(top.gather(1, top.abs().argmax(dim=1, keepdim=True)))
    rows = top * signs
    if rows.shape[0] < rank:
        if fallback is None:
            raise ValueError(f"a {tuple(m.shape)} matrix of rank {num_kept} has no {rank} input directions")
        extra = fallback.detach().to(dtype=torch.float64, device="cpu")[rows.shape[0]:]
        basis = [row for row in rows]
        for row in extra:
            for kept in basis:
                row = row - (row @ kept) * kept
            basis.append(row / row.norm())
        rows = torch.stack(basis)
    return (rows / math.sqrt(3.0)).to(torch.float32)


def _full_weight(module, kind: str) -> torch.Tensor:
    """The full base weight of a (TP-sharded) linear on every rank (`_gathered`)."""
    return _gathered(module.weight.detach(), module.tp_group, kind)


def _gathered(shard: torch.Tensor, group, kind: str) -> torch.Tensor:
    """The full [out, in] matrix of a linear's TP shard on every rank: the shards gathered along the output dim of a
    column-parallel linear, the input dim of a row-parallel one."""
    if group.size() == 1:
        return shard
    import torch.distributed as dist

    shards = [torch.empty_like(shard) for _ in range(group.size())]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return torch.cat(shards, dim=0 if kind == "column" else 1)


def attach_lora(model, settings: LoraSettings, groups: ProcessGroups | None = None) -> int:
    """Attach adapters to the target linears of `model` (a GPTModel or a list of chunks) and freeze every other
    parameter; returns how many linears were adapted on this rank. Call after the base weights are loaded and
    before DDP and the optimizer are built."""
    from stacx.models.builder import model_chunks, unwrap_model

    adapted = 0
    for chunk in model_chunks(model):
        gpt = unwrap_model(chunk)
        for param in gpt.parameters():
            param.requires_grad_(False)
        global_names = _global_names(gpt)
        for name, module in list(gpt.named_modules()):
            target = target_of(name)
            if target is None or target not in settings.targets or name not in global_names:
                continue
            _adapt(module, name, global_names[name], settings)
            adapted += 1
    return adapted


def _adapt(module, name: str, global_name: str, settings: LoraSettings) -> None:
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    kind = "column" if name.rsplit(".", 1)[-1] in _COLUMN else "row"
    if not isinstance(module, ColumnParallelLinear if kind == "column" else RowParallelLinear):
        # transformer-engine's linears (the GPU layer spec) fuse the layer norm into linear_qkv and linear_fc1,
        # whose adapter must read the normalized input: not supported yet.
        raise ValueError(f"LoRA on {name}: {type(module).__name__} is not megatron-core's "
                         f"{'Column' if kind == 'column' else 'Row'}ParallelLinear (transformer-engine's layer spec is "
                         "not supported yet); run without --lora-rank there")
    tp_size = module.tp_group.size()
    if getattr(module, "explicit_expert_comm", False) and tp_size > 1:
        raise ValueError(f"LoRA on routed experts at --expert-tensor-parallel-size {tp_size} is not supported "
                         f"({name}); set --expert-tensor-parallel-size 1 or drop `experts` from --lora-target-modules")
    if getattr(module, "gather_output", False):
        raise ValueError(f"LoRA on {name}: a column-parallel linear that gathers its output is not supported")
    out_local, in_local = module.weight.shape
    full_in = in_local * tp_size if kind == "row" else in_local
    if settings.init == "principal":
        a_full = _principal_a(_full_weight(module, kind), settings.rank,
                              fallback=_init_a(settings, global_name, full_in))
    else:  # random; a gradient init starts from it until the first batch's gradients set A (init_a_from_gradients)
        a_full = _init_a(settings, global_name, full_in)
    rank = module.tp_group.rank()
    a_local = a_full[:, rank * in_local:(rank + 1) * in_local] if kind == "row" else a_full
    dtype, device = module.weight.dtype, module.weight.device
    module.lora_a = torch.nn.Parameter(a_local.to(dtype=dtype, device=device).contiguous())
    module.lora_b = torch.nn.Parameter(torch.zeros(out_local, settings.rank, dtype=dtype, device=device))
    sequence_parallel = bool(getattr(module, "sequence_parallel", False)) and tp_size > 1
    if kind == "column":
        module.lora_b.tensor_model_parallel, module.lora_b.partition_dim, module.lora_b.partition_stride = True, 0, 1
        # Each TP rank saw its part of the sequence: A's gradient is summed over TP (finalize_model_grads).
        module.lora_a.sequence_parallel = sequence_parallel
    else:
        module.lora_a.tensor_model_parallel, module.lora_a.partition_dim, module.lora_a.partition_stride = True, 1, 1
    module.lora_routed = _ROUTED_EXPERTS in name
    if module.lora_routed:
        for param in (module.lora_a, module.lora_b):
            param.allreduce = False  # reduced over expert-data-parallel ranks, like the expert's weight
    module.lora_kind, module.lora_scale = kind, settings.scale
    module.lora_dropout, module.lora_sequence_parallel = settings.dropout, sequence_parallel
    module.lora_global_name = global_name
    module.__class__ = _adapted_class(type(module))


def adapted_linears(model) -> list:
    """Every adapted linear of `model` (a GPTModel, a wrapper or a list of chunks), in module order."""
    from stacx.models.builder import model_chunks

    return [module for chunk in model_chunks(model) for module in chunk.modules()
            if isinstance(module, LoraLinearMixin)]


def has_lora(model) -> bool:
    return bool(adapted_linears(model))


def adapter_parameters(model) -> list[torch.nn.Parameter]:
    return [p for module in adapted_linears(model) for p in (module.lora_a, module.lora_b)]


@contextlib.contextmanager
def adapters_disabled(model):
    """Run `model` as its base: every adapter's term is left out inside the block (no copy of any weight)."""
    modules = adapted_linears(model)
    before = [module.lora_enabled for module in modules]
    for module in modules:
        module.lora_enabled = False
    try:
        yield
    finally:
        for module, enabled in zip(modules, before):
            module.lora_enabled = enabled


@contextlib.contextmanager
def base_weight_gradients(model):
    """Inside the block every adapted linear's base weight takes a gradient (megatron's linear then computes its
    weight gradient, gathering a sequence-parallel input as for training) into `weight.grad`, outside the DDP
    buffers; after it the weights are frozen again and the gradients dropped. What `init_a_from_gradients` reads."""
    modules = adapted_linears(model)
    for module in modules:
        module.weight.grad = None
        module.weight.requires_grad_(True)
    try:
        yield modules
    finally:
        for module in modules:
            module.weight.requires_grad_(False)
            module.weight.grad = None


@torch.no_grad()
def init_a_from_gradients(model, settings: LoraSettings, groups: ProcessGroups) -> int:
    """Set every adapter's A from its base weight's gradient (in `weight.grad`, from a forward and backward inside
    `base_weight_gradients`), B to zero: A's rows along the top-r right singular vectors of the full gradient G
    [out, in] (`top_input_directions`), or of sign(G) with `--lora-init gradient-sign`. Each rank holds a part of
    G: its data's (summed over DP x CP, a routed expert's over expert-DP, as training sums the gradients) and its
    TP shard's (gathered as `principal` gathers the weight: the output dim of a column-parallel linear, the input
    dim of a row-parallel one); a pipeline stage sets its own layers' A. A direction G lacks (no token reached a
    routed expert) keeps the random init's row, made orthogonal to the others. One linear at a time (its gradient
    dropped once used). Collective over those groups; returns the number of A set from a nonzero gradient on this
    rank."""
    import torch.distributed as dist

    from_gradient = 0
    for module in adapted_linears(model):
        grad = module.weight.grad
        if grad is None:
            raise RuntimeError(f"{module.lora_global_name}: no weight gradient; run the forward and backward inside "
                               "base_weight_gradients")
        grad = grad.detach().to(torch.float32).contiguous()
        module.weight.grad = None
        group = groups.edp if module.lora_routed else groups.dp_cp
        if group is not None and group.size() > 1:
            dist.all_reduce(grad, group=group)
        full = _gathered(grad, module.tp_group, module.lora_kind)
        if settings.init == "gradient-sign":
            full = full.sign()
        fallback = _init_a(settings, module.lora_global_name, full.shape[1])
        a_full = top_input_directions(full, settings.rank, fallback=fallback)
        in_local = module.lora_a.shape[1]
        rank = module.tp_group.rank()
        a_local = a_full[:, rank * in_local:(rank + 1) * in_local] if module.lora_kind == "row" else a_full
        module.lora_a.copy_(a_local.to(module.lora_a.dtype))
        module.lora_b.zero_()
        from_gradient += int(bool(full.any()))
    return from_gradient


def merged_weight(gpt_model, megatron_name: str, param: torch.Tensor) -> torch.Tensor:
    """`param`, or for the weight of an adapted linear this rank's shard of W + scale * B A."""
    if not megatron_name.endswith(".weight"):
        return param
    module = gpt_model.get_submodule(megatron_name.rsplit(".", 1)[0])
    if isinstance(module, LoraLinearMixin) and module.lora_enabled:
        return module.lora_merged_weight()
    return param


# ---- Hugging Face (PEFT) names of the adapters ----------------------------------------------------------------

def adapter_param_mappings(gpt_model) -> list:
    """A `ParamMapping` per adapter parameter of an (unwrapped) GPTModel, to PEFT's tensor names without the
    `base_model.model.` prefix (`model.layers.0.self_attn.q_proj.lora_B.weight`). B of a column-parallel
    linear has the base weight's row layout (its kind: qkv, gate_up), A of a row-parallel one its column
    layout (row); the other is replicated."""
    from stacx.models.weight_mapping import ParamMapping, _first_local_experts, _match, layer_offset

    offset, first_experts = layer_offset(gpt_model), _first_local_experts(gpt_model)
    mappings = []
    for name, param in gpt_model.named_parameters():
        if not is_adapter_param_name(name):
            continue
        module_name, which = name.rsplit(".", 1)
        kind, hf_names, routed = _match(module_name + ".weight", offset,
                                        first_experts.get(name.split(_ROUTED_EXPERTS)[0], 0))
        suffix = ".lora_A.weight" if which == "lora_a" else ".lora_B.weight"
        hf_names = tuple(hf.removesuffix(".weight") + suffix for hf in hf_names)
        column = kind in ("qkv", "gate_up")
        if which == "lora_a":
            kind, hf_names = ("replicated", hf_names[:1]) if column else ("row", hf_names)
        elif not column:
            kind = "replicated"
        mappings.append(ParamMapping(name, kind, hf_names, tuple(param.shape), routed))
    return mappings


def peft_adapter_config(settings: LoraSettings, base_model: str | None) -> dict:
    """adapter_config.json of a PEFT LoRA adapter with these settings."""
    modules = hf_target_modules(settings.targets)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
            "lora_dropout": settings.dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": settings.rslora, "base_model_name_or_path": base_model, "inference_mode": True}


def engine_adapter_config(settings: LoraSettings) -> dict:
    """The PEFT config an inference engine (vLLM, SGLang) is given with adapter-only pushes: the export's, with the
    scale written as a plain lora_alpha / r (lora_alpha = scale x r, use_rslora false), so an engine that reads only
    lora_alpha / r (SGLang's LoRA loading ignores use_rslora) applies the run's scale under --lora-rslora too."""
    return {**peft_adapter_config(settings, base_model=None), "lora_alpha": settings.scale * settings.rank,
            "use_rslora": False}


def is_peft_adapter_folder(path) -> bool:
    """Whether `path` is a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."""
    import os

    return all(os.path.isfile(os.path.join(path, name)) for name in (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE))


@torch.no_grad()
def load_peft_adapter(model, path: str, groups: ProcessGroups, settings: LoraSettings, *, flag: str = "--load") -> None:
    """Copy a PEFT LoRA folder's adapters into `model`'s adapters (each rank its shard). The folder's r,
    lora_alpha and use_rslora must be the run's; a fused linear's Hugging Face modules (q, k, v; gate, up) must
    share one A (as Stacx writes them). Raises ValueError naming `flag` otherwise."""
    import json
    import os

    from safetensors.torch import load_file

    from stacx.models.architectures import decoder_shape
    from stacx.models.builder import hf_config_of, model_chunks, unwrap_model

    config = json.loads(open(os.path.join(path, PEFT_CONFIG_FILE)).read())
    if int(config.get("r", -1)) != settings.rank or float(config.get("lora_alpha", -1)) != settings.alpha:
        raise ValueError(f"{flag} {path}: a PEFT adapter of r={config.get('r')}, lora_alpha={config.get('lora_alpha')}; "
                         f"set --lora-rank {config.get('r')} --lora-alpha {config.get('lora_alpha')}")
    if bool(config.get("use_rslora", False)) != settings.rslora:
        raise ValueError(f"{flag} {path}: a PEFT adapter with use_rslora {bool(config.get('use_rslora', False))}, "
                         f"scaled by lora_alpha / {'sqrt(r)' if config.get('use_rslora') else 'r'}; "
                         f"{'set' if config.get('use_rslora') else 'drop'} --lora-rslora")
    tensors = {name.removeprefix("base_model.model."): t for name, t in load_file(os.path.join(path, PEFT_WEIGHTS_FILE)).items()}
    for chunk in model_chunks(model):
        gpt = unwrap_model(chunk)
        shape = decoder_shape(hf_config_of(gpt))
        params = dict(gpt.named_parameters())
        for mapping in adapter_param_mappings(gpt):
            for hf_name in mapping.hf_names:
                if hf_name not in tensors:
                    raise ValueError(f"{flag} {path}: no tensor {hf_name!r}; the adapter targets other modules than "
                                     f"--lora-target-modules {' '.join(settings.target_modules)}")
                module, _, _ = hf_name.removesuffix(".lora_A.weight").rpartition(".")
                for sibling in SHARED_A.get(hf_name.removesuffix(".lora_A.weight").rsplit(".", 1)[-1], ()):
                    other = tensors.get(f"{module}.{sibling}.lora_A.weight")
                    if hf_name.endswith(".lora_A.weight") and other is not None and not torch.equal(other, tensors[hf_name]):
                        raise ValueError(f"{flag} {path}: {hf_name} and {module}.{sibling}.lora_A.weight differ; Stacx's "
                                         "fused linear has one A for them (load adapters written by Stacx)")
            rank, size = mapping.shard_rank_and_size(groups)
            pieces = []
            for hf_name, part in zip(mapping.hf_names, mapping.local_slices(shape, rank, size)):
                full = tensors[hf_name]
                pieces.append(full if part.dim is None else full.narrow(part.dim, part.start, part.stop - part.start))
            params[mapping.megatron_name].copy_(mapping.assemble_local(pieces, shape, size))


class MergedAdapters:
    """An inference model's adapters, merged into its weights: the receiving end of an adapter-only weight sync.

    The adapters are attached but switched off (the forward reads the plain weights, so a decoder that mirrors
    them, such as the CPU engine's KV-cache decoder, needs nothing new); each adapted linear's base weight W0
    is kept, and `apply` sets W = W0 + scale * B A from the adapters last received. Unmerging is exact (W0 is
    copied back, never subtracted)."""

    def __init__(self, model, settings: LoraSettings, groups: ProcessGroups | None = None):
        attach_lora(model, settings, groups)
        self.modules = adapted_linears(model)
        for module in self.modules:
            module.lora_enabled = False
        self.base_weights = [module.weight.detach().clone() for module in self.modules]

    @torch.no_grad()
    def apply(self) -> None:
        for module, base in zip(self.modules, self.base_weights):
            module.weight.copy_(base + module.lora_scale * (module.lora_b @ module.lora_a).to(base.dtype))

    @torch.no_grad()
    def unmerge(self) -> None:
        for module, base in zip(self.modules, self.base_weights):
            module.weight.copy_(base)
