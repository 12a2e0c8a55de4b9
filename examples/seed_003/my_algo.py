"""Guide 003, "5 Adding an algorithm", steps 1 and 2 as written (package paths changed only:
rl_engine.trainer.specialization -> stacx.specializations, rl_engine.trainer.objectives.policy_loss
-> stacx.objectives.policy_losses, rl_engine.trainer.recipes -> stacx.trainer.recipes). The guide
leaves "derive per-token student logprobs" and `my_kernel` to the reader; here they are
`self.response_log_probs(model_output, batch)` and a negative log-likelihood. Specialization and
recipe share this one file, so the recipe function needs no import of the class. Step 3:

    stacx train --custom-module examples/seed_003/my_algo.py --algorithm my_algo \
        --hf-checkpoint <student> --ref-load <student> ...
"""

from collections.abc import Callable
from typing import Any
import torch
from stacx.specializations.causal_decoder import CausalDecoderSpecialization
from stacx.objectives.policy_losses import sum_of_sample_mean
from stacx.trainer.recipes import recipe
from stacx.trainer.config.recipe import ModelRole, TrainingConfig


def my_kernel(log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token loss [N_response]: the negative log-likelihood of each response token."""
    return -log_probs


class MyAlgoSpecialization(CausalDecoderSpecialization):
    def compute_loss(
        self,
        model_output: torch.Tensor,          # [seq_len, vocab] (TP-local shard if TP>1)
        batch: dict[str, Any],
        reducer: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        response_lengths = batch["response_lengths"]
        loss_masks = batch["loss_masks"]
        # ... derive per-token student logprobs from model_output, then:
        log_probs = self.response_log_probs(model_output, batch)  # [N_response], TP/CP handled
        per_token = my_kernel(log_probs)                       # shape [N_response]
        loss = sum_of_sample_mean(per_token, response_lengths, loss_masks)
        loss = reducer(loss)                             # slime CP-aware reduction
        return loss, {"my_loss": loss.detach()}


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
        description="My custom reverse-KL algorithm",
    )
