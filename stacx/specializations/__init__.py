"""Per-algorithm loss assembly: `compute_loss(model_output, micro_batch, reducer) -> (loss, metrics)`.

See base.py for the template (a subclass writes `per_token_terms`), batch.py for `MicroBatch`, and
docs/adding-an-algorithm.md for writing a new one.
"""

from stacx.specializations.actor import ActorSpecialization
from stacx.specializations.base import LossTerms, ResponseView, Specialization
from stacx.specializations.batch import MicroBatch, model_inputs, pack_micro_batch
from stacx.specializations.causal_decoder import CausalDecoderSpecialization
from stacx.specializations.critic import CriticSpecialization
from stacx.specializations.distill import DistillSpecialization
from stacx.specializations.dpo import DPOSpecialization
from stacx.specializations.mixed_loss_dagger import MixedLossDaggerOPDSpecialization

__all__ = [
    "ActorSpecialization",
    "CausalDecoderSpecialization",
    "CriticSpecialization",
    "DPOSpecialization",
    "DistillSpecialization",
    "LossTerms",
    "MicroBatch",
    "MixedLossDaggerOPDSpecialization",
    "ResponseView",
    "Specialization",
    "model_inputs",
    "pack_micro_batch",
]
