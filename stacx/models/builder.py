"""Build a megatron-core GPTModel from a Hugging Face config for one (tp, cp) layout.

    model = build_model("path/to/hf_folder", groups)            # random weights, right shapes
    load_hf_checkpoint(model, "path/to/hf_folder", groups)      # stacx.models.checkpoint

On GPU with transformer-engine importable the layer spec is transformer-engine's; otherwise
megatron-core's local spec with Stacx's `PackedCoreAttention`. The vocab is padded to a
multiple of tp (`padded_vocab_size`); `hf_config_of(model)` gives the config back, whose
`vocab_size` is the real, unpadded one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dataclasses import dataclass

from stacx.models.architectures import (
    DecoderShape,
    check_expert_parallel_sizes,
    check_pipeline_parallel_size,
    check_tensor_parallel_size,
    decoder_shape,
    load_hf_config,
    padded_vocab_size,
)
from stacx.parallel.groups import ProcessGroups
from stacx.parallel.moe_dispatch import use_uneven_allgather_dispatch

_HF_CONFIG_ATTR = "stacx_hf_config"


def transformer_engine_available() -> bool:
    """True when CUDA is usable and transformer-engine imports (the GPU layer spec)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken TE install means "use the local spec"
        return False
    return True


@dataclass(frozen=True, kw_only=True)
class RouterLosses:
    """The router's auxiliary losses of a mixture-of-experts model (run settings, megatron's names)."""

    aux_loss_coeff: float = 0.0
    """--moe-aux-loss-coeff: weight of the load-balancing loss E * sum_e f_e * P_e (f_e: the fraction of
    routed token slots that chose expert e, P_e: its mean routing probability); 0 turns it off."""
    z_loss_coeff: float = 0.0
    """--moe-z-loss-coeff: weight of the router z-loss mean_t (logsumexp_e logits_te)^2; 0 turns it off."""

    def __post_init__(self):
        for flag, value in (("--moe-aux-loss-coeff", self.aux_loss_coeff), ("--moe-z-loss-coeff", self.z_loss_coeff)):
            if not value >= 0.0:
                raise ValueError(f"{flag} must be >= 0, got {value}")


def _moe_fields(shape: DecoderShape, groups: ProcessGroups, router_losses: RouterLosses) -> dict:
    """TransformerConfig fields of the MoE layers: megatron's router reproduces Hugging Face's top-k softmax
    (renormalized top-k = softmax over the top-k logits; otherwise softmax first, then top-k)."""
    if shape.moe is None:
        return {}
    moe = shape.moe
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_router_pre_softmax=not moe.normalize_top_k,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.shared_expert_ffn_hidden_size > 0,
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss" if router_losses.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=router_losses.aux_loss_coeff,
        moe_z_loss_coeff=router_losses.z_loss_coeff or None,
        expert_model_parallel_size=groups.ep_size,
        expert_tensor_parallel_size=groups.etp_size,
    )


def _kernel_fusions(on_cpu: bool) -> dict[str, bool]:
    """megatron's fused-kernel switches: those that need CUDA-only kernels or extensions
    (transformer-engine, apex) off everywhere, the torch-compiled ones on a GPU only."""
    return {"apply_rope_fusion": False, "bias_activation_fusion": False, "masked_softmax_fusion": False,
            "gradient_accumulation_fusion": False, "bias_dropout_fusion": not on_cpu, "persist_layer_norm": not on_cpu}


def build_transformer_config(
    shape: DecoderShape, groups: ProcessGroups, params_dtype: torch.dtype, initializer_range: float, initialize_weights: bool = True,
    router_losses: RouterLosses = RouterLosses(), sequence_parallel: bool = False,
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = not torch.cuda.is_available()
    pipelined = groups.pp_size > 1
    # MoE layers: all-to-all needs CUDA streams; all-gather runs over gloo (each rank then keeps its experts' tokens).
    dispatcher = "allgather" if on_cpu else "alltoall"
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.architecture.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=initializer_range,
        perform_initialization=initialize_weights,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=groups.tp_size,
        # Sequence parallelism means something only across TP ranks (megatron refuses it at tp = 1).
        sequence_parallel=sequence_parallel and groups.tp_size > 1,
        context_parallel_size=groups.cp_size,
        pipeline_model_parallel_size=groups.pp_size,
        virtual_pipeline_model_parallel_size=groups.vp_size if groups.vp_size > 1 else None,
        # Between stages megatron sends activations of a packed micro-batch, whose length varies:
        # with variable_seq_lengths it sends each one's shape first (stacx.parallel.pipeline).
        pipeline_dtype=params_dtype if pipelined else None,
        variable_seq_lengths=pipelined and dispatcher != "allgather",
        moe_token_dispatcher_type=dispatcher,
        use_cpu_initialization=on_cpu,
        **_kernel_fusions(on_cpu),
        **_moe_fields(shape, groups, router_losses),
    )
    if pipelined:
        # megatron refuses variable_seq_lengths with the allgather dispatcher, whose all-gather over EP x TP
        # needs the same token count on those ranks (Stacx pads to it: stacx.parallel.moe_dispatch). The flag
        # only makes the pipeline send each activation's shape ahead of it (p2p_communication), which the
        # dispatcher never sees.
        config.variable_seq_lengths = True
    return config


class TorchRMSNorm:
    """The local spec's RMSNorm (torch's) that also runs under sequence parallelism, which megatron's
    `WrappedTorchNorm` refuses: the norm is per token, so it needs nothing but its weight marked
    `sequence_parallel`, which has megatron's `finalize_model_grads` sum the weight's gradient over
    TP (each TP rank normalized only its part of the sequence)."""

    splits_sequence = True
    """False for the q/k norms: they run after attention's all-gather, on the whole sequence (their
    gradient is partial over TP anyway, by heads; megatron sums it as `qk_layernorm`)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel and cls.splits_sequence
        return norm


class TorchQKRMSNorm(TorchRMSNorm):
    splits_sequence = False


def _block_spec(shape: DecoderShape, transformer_config):
    """The decoder's spec: `_layer_spec`, or under sequence parallelism on the local spec a block spec
    (this stage's layers and the final norm) whose norms are `TorchRMSNorm`."""
    # Imported here, like megatron above: `stacx.models` stays light for the driver.
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = _layer_spec(shape)
    if not transformer_config.sequence_parallel or transformer_engine_available():
        return spec
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(spec.submodules, name).__name__ == "WrappedTorchNorm":
            setattr(spec.submodules, name, TorchRMSNorm)
    attention = spec.submodules.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(getattr(attention, name, None), "__name__", "") == "WrappedTorchNorm":
            setattr(attention, name, TorchQKRMSNorm)
    num_layers = get_num_layers_to_build(transformer_config)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=TorchRMSNorm)


def _layer_spec(shape: DecoderShape):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    # Imported here, like megatron above: `stacx.models` stays light for the driver, which reads
    # checkpoint folders and configs but never builds a model (megatron-core takes seconds to import).
    from stacx.models.packed_attention import PackedCoreAttention

    num_experts = shape.moe.num_experts if shape.moe is not None else None
    if transformer_engine_available():
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=shape.architecture.qk_layernorm)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=shape.architecture.qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    return spec


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    """Llama 3.x RoPE frequency scaling with the config's own factors.

    wavelen = 2*pi / f. Long wavelengths (> original_max / low_freq_factor) are divided by
    `factor`, short ones (< original_max / high_freq_factor) kept, and the band between
    interpolates with smooth = (original_max / wavelen - low) / (high - low):
    f' = (1 - smooth) * f / factor + smooth * f.
    """
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    inv_freq = inv_freq.double()
    wavelen = 2 * torch.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    scaled = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return scaled.float()


def build_model(hf_config, groups: ProcessGroups, *, params_dtype: torch.dtype = torch.float32, initialize_weights: bool = True,
                router_losses: RouterLosses = RouterLosses(), sequence_parallel: bool = False):
    """A megatron-core GPTModel matching `hf_config` (PretrainedConfig, dict, folder or config.json); with
    virtual pipeline stages (groups.vp_size > 1) the list of this rank's model chunks (`model_chunks`).

    Weights are freshly initialized (left uninitialized with initialize_weights=False, which is
    faster when a checkpoint is loaded next); load real ones with `load_hf_checkpoint`. Dropout is 0.
    A mixture-of-experts config gets MoE layers sharded over `groups`' expert grid (ep, etp), with
    `router_losses` (ignored for a dense model). `sequence_parallel` (--sequence-parallel, at tp > 1):
    megatron's sequence parallelism, the activations outside attention and the MLP split along the
    sequence over TP (`forward_packed` pads and gathers for it). Raises ValueError for an unsupported architecture,
    a tp that does not divide the heads or an ep that does not divide the experts.
    """
    from megatron.core.models.gpt import GPTModel

    config = load_hf_config(hf_config)
    shape = decoder_shape(config)
    check_tensor_parallel_size(shape, groups.tp_size)
    check_expert_parallel_sizes(shape, groups.ep_size, groups.etp_size)
    check_pipeline_parallel_size(shape, groups.pp_size, groups.vp_size)
    transformer_config = build_transformer_config(
        shape, groups, params_dtype, float(getattr(config, "initializer_range", 0.02)), initialize_weights,
        router_losses, sequence_parallel,
    )
    if groups.vp_size > 1:
        # Interleaved stages: chunk c of pipeline rank r holds the layers of virtual stage c * pp + r; the
        # embedding lives in chunk 0 of the first rank, the head in the last chunk of the last rank.
        return [_build_chunk(config, shape, transformer_config, groups, initialize_weights, vp_stage=chunk)
                for chunk in range(groups.vp_size)]
    return _build_chunk(config, shape, transformer_config, groups, initialize_weights, vp_stage=None)


def _build_chunk(config, shape: DecoderShape, transformer_config, groups: ProcessGroups, initialize_weights: bool, *,
                 vp_stage: int | None):
    from megatron.core.models.gpt import GPTModel

    last_chunk = vp_stage is None or vp_stage == groups.vp_size - 1
    model = GPTModel(
        config=transformer_config,
        transformer_layer_spec=_block_spec(shape, transformer_config),
        vocab_size=padded_vocab_size(shape.vocab_size, groups.tp_size),
        max_sequence_length=shape.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=shape.rope_theta,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        pre_process=groups.is_first_stage and not vp_stage,
        post_process=groups.is_last_stage and last_chunk,
        vp_stage=vp_stage,
    )
    if not initialize_weights:
        mark_tensor_parallel_params(model)
    use_uneven_allgather_dispatch(model)  # DP ranks of one expert-parallel group pack different token counts
    if shape.rope_scaling is not None:
        rope = model.rotary_pos_emb
        rope.inv_freq = llama3_scaled_inv_freq(rope.inv_freq.cpu(), shape.rope_scaling).to(rope.inv_freq.device)
    setattr(model, _HF_CONFIG_ATTR, config)
    return model


def mark_tensor_parallel_params(gpt_model) -> None:
    """Mark every TP-sharded parameter (`tensor_model_parallel`, `partition_dim`) as megatron does
    while initializing it. Without initialization megatron leaves the marks off, and its grad norm
    (hence clipping) then counts the shards of TP rank 0 only."""
    from stacx.models.weight_mapping import param_mappings

    params = dict(gpt_model.named_parameters())
    for mapping in param_mappings(gpt_model):
        param = params[mapping.megatron_name]
        if mapping.kind == "replicated" or getattr(param, "tensor_model_parallel", False):
            continue
        param.tensor_model_parallel = True
        param.partition_dim = 1 if mapping.kind == "row" else 0
        param.partition_stride = 1


def model_chunks(model) -> list:
    """The model chunks of `model`: the list itself (virtual pipeline stages), else [model]."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def unwrap_model(model):
    """The GPTModel inside DDP / Float16Module wrappers (megatron wraps with `.module`)."""
    while not hasattr(model, _HF_CONFIG_ATTR) and hasattr(model, "module"):
        model = model.module
    return model


def hf_config_of(model):
    """The Hugging Face config a model was built from; `.vocab_size` is the real (unpadded) vocab."""
    inner = unwrap_model(model_chunks(model)[0])
    if not hasattr(inner, _HF_CONFIG_ATTR):
        raise ValueError("model was not built by stacx.models.build_model (it carries no Hugging Face config)")
    return getattr(inner, _HF_CONFIG_ATTR)
