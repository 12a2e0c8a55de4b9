"""megatron-core decoders built from Hugging Face configs, TP/CP sharded, with checkpoint conversion.

Public API:
- build_model(hf_config, groups, *, params_dtype) -> GPTModel (a list of chunks with virtual stages: model_chunks); hf_config_of(model)
- forward_packed(model, tokens, padded_lengths, groups, *, lm_head) -> TP-local fp32 logits (or an LMHeadShard)
- load_hf_checkpoint / export_hf_checkpoint / iter_hf_weight_buckets
- stacx.models.testing: tiny_hf_config, save_tiny_hf_checkpoint
"""

from stacx.models.architectures import ARCHITECTURES, padded_vocab_size
from stacx.models.builder import build_model, hf_config_of, model_chunks, transformer_engine_available, unwrap_model
from stacx.models.checkpoint import (
    CheckpointMismatchError,
    export_hf_checkpoint,
    iter_hf_weight_buckets,
    load_hf_checkpoint,
)
from stacx.models.forward import forward_packed, mask_vocab_padding

__all__ = [
    "ARCHITECTURES",
    "CheckpointMismatchError",
    "build_model",
    "model_chunks",
    "export_hf_checkpoint",
    "forward_packed",
    "hf_config_of",
    "iter_hf_weight_buckets",
    "load_hf_checkpoint",
    "mask_vocab_padding",
    "padded_vocab_size",
    "transformer_engine_available",
    "unwrap_model",
]
