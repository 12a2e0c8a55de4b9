"""A whole algorithm in one file, written to the specialization template: the base class checks
the batch, cuts the responses for TP/CP, reduces the loss and counts tokens; the algorithm writes
only its per-token terms (`per_token_terms`). `my_kernel` here is the negative log-likelihood of the
policy's own samples (self-imitation); put your kernel in its place. The older form (overriding `compute_loss`, reading
`batch["loss_masks"]`, `reducer(sum_of_sample_mean(...))`) still runs; see docs/adding-an-algorithm.md.
Specialization and recipe share this one file, so the recipe needs no import of the class. Run it:

    stacx train --custom-module examples/specialization_in_one_file/my_algo.py --algorithm my_algo \
        --hf-checkpoint <student> --prompt-data builtin:sorting
"""

import torch
from stacx.specializations.base import LossTerms, masked_total
from stacx.specializations.causal_decoder import CausalDecoderSpecialization
from stacx.trainer.recipes import recipe
from stacx.trainer.config.recipe import ModelRole, TrainingConfig


def my_kernel(log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token loss [R_i]: the negative log-likelihood of each response token."""
    return -log_probs


class MyAlgoSpecialization(CausalDecoderSpecialization):
    def per_token_terms(self, view, batch) -> LossTerms:
        per_token = [my_kernel(log_probs) for log_probs in view.values]  # one [R_i] per response, TP/CP handled
        return LossTerms(per_token, {"my_loss": masked_total(per_token, view.loss_masks)})


@recipe("my_algo")
def my_algo_config():
    return TrainingConfig(
        name="my_algo",
        roles=(
            ModelRole(
                name="policy",
                specialization_cls=MyAlgoSpecialization,
                sync_to_rollout=True,          # push weights to the engine each step
            ),
        ),
        syncs=(),                                # single role → no cross-model sync
        description="Self-imitation: the negative log-likelihood of the policy's own samples",
    )
