"""Where a step's samples come from, and how they are cut into per-rank micro-batches.

A step batch is a dict of per-sample lists (what `stacx.rollout.manager.samples_to_batch` gives):
    tokens [L_i] int64, response_lengths R_i, loss_masks [R_i], rollout_log_probs [R_i], rewards,
    group_indices, teacher fields; DPO adds pair_ids / is_chosen.
Forward-only passes and the advantage estimator add fields (ref_log_probs, values, advantages,
returns) to the same dict; every role's specialization reads the fields it needs.

Sources (`StepDataSource`):
- rollout recipes: prompts (`rollout.prompt_data`, kind 'prompt') in a resumable epoch order;
- 'dataset' recipes: SFT rows (prompt + response) or DPO rows (prompt, chosen, rejected);
- online_dagger with `dagger_sft_mode: trajectory`: SFT on a saved teacher corpus.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from stacx.trainer.preflight import check_examples

PER_SAMPLE_SCALARS = ("response_lengths", "rewards", "group_indices", "pair_ids", "is_chosen")


def num_samples(batch: Mapping[str, Any]) -> int:
    return len(batch["tokens"])


def select(batch: Mapping[str, Any], indices: Sequence[int]) -> dict[str, list]:
    """The sub-batch of samples `indices` (every per-sample list, in that order)."""
    return {key: [values[i] for i in indices] for key, values in batch.items() if values is not None}


def sft_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              loss_masks: Sequence[Sequence[int]] | None = None) -> dict[str, list]:
    """Supervised samples: tokens = prompt + response, loss on the response (or the given masks)."""
    batch = {"tokens": [], "response_lengths": [], "loss_masks": []}
    for index, (prompt, response) in enumerate(zip(prompts, responses)):
        if not prompt or not response:
            raise ValueError(f"SFT sample {index} needs a non-empty prompt and response")
        batch["tokens"].append(torch.tensor(list(prompt) + list(response), dtype=torch.long))
        batch["response_lengths"].append(len(response))
        mask = loss_masks[index] if loss_masks is not None else [1] * len(response)
        batch["loss_masks"].append(torch.tensor(mask, dtype=torch.float32))
    return batch


def dpo_batch(examples: Sequence[Any]) -> dict[str, list]:
    """Pairs as two samples each: chosen (is_chosen=1) then rejected, sharing a pair id."""
    prompts, responses, pair_ids, is_chosen = [], [], [], []
    for pair, example in enumerate(examples):
        for chosen, response in ((1, example.chosen_ids), (0, example.rejected_ids)):
            prompts.append(example.prompt_ids)
            responses.append(response)
            pair_ids.append(pair)
            is_chosen.append(chosen)
    batch = sft_batch(prompts, responses)
    batch["pair_ids"], batch["is_chosen"] = pair_ids, is_chosen
    return batch


def packing_units(batch: Mapping[str, Any]) -> list[list[int]]:
    """Groups of samples that must share a micro-batch: DPO pairs, else single samples."""
    if "pair_ids" not in batch:
        return [[i] for i in range(num_samples(batch))]
    units: dict[Any, list[int]] = {}
    for index, pair in enumerate(batch["pair_ids"]):
        units.setdefault(pair, []).append(index)
    return list(units.values())


def plan_micro_batches(batch: Mapping[str, Any], *, dp_size: int, cp_size: int,
                       max_tokens_per_micro_batch: int) -> list[list[list[int]]]:
    """[dp_rank][micro_batch] -> sample indices, balanced by tokens, same micro-batch count per rank."""
    from stacx.parallel.cp_layout import round_up
    from stacx.parallel.packing import pack_micro_batches

    units = packing_units(batch)
    if len(units) < dp_size:
        raise ValueError(f"the step has {len(units)} samples (or pairs) for {dp_size} data-parallel ranks; "
                         "raise rollout_batch_size / n_samples_per_prompt or lower data_parallel_size")
    pad = 2 * cp_size if cp_size > 1 else 1
    lengths = [sum(round_up(int(batch["tokens"][i].shape[0]), pad) for i in unit) for unit in units]
    longest = max(lengths)
    if longest > max_tokens_per_micro_batch:
        raise ValueError(f"a sample (or pair) of {longest} tokens exceeds max_tokens_per_micro_batch="
                         f"{max_tokens_per_micro_batch}")
    plan = pack_micro_batches(lengths, dp_size=dp_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    per_rank = [[[i for unit in mb for i in units[unit]] for mb in rank] for rank in plan.micro_batches]
    for rank, micro_batches in enumerate(per_rank):
        if any(not mb for mb in micro_batches):
            raise ValueError(f"data-parallel rank {rank} got an empty micro-batch; the step has too few samples")
    return per_rank


def data_kind(training_config) -> str:
    """'prompt' for rollout recipes, 'dpo' for preference recipes, else 'sft'."""
    from stacx.specializations.dpo import DPOSpecialization

    if training_config.data_source == "rollout":
        return "prompt"
    role = training_config.trainable_roles[0]
    return "dpo" if issubclass(role.specialization_cls, DPOSpecialization) else "sft"


class StepDataSource:
    """Examples for each step in a deterministic, checkpointable epoch order."""

    def __init__(self, run_config, training_config, tokenizer):
        from stacx.rollout.data import DataConfig, EpochLoader, load_examples

        from stacx.rollout.env_overrides import apply_env_overrides

        rollout = run_config.rollout
        self.kind = data_kind(training_config)
        self.batch_size = rollout.rollout_batch_size
        teacher = apply_env_overrides(run_config.teacher)  # STACX_DAGGER_SFT_MODE picks replay or live
        if training_config.rollin_protocol == "teacher_relabel" and teacher.dagger_sft_mode == "trajectory":
            if not teacher.trajectory_corpus:
                raise ValueError("dagger_sft_mode 'trajectory' needs --trajectory-corpus")
            from stacx.rollout.data import load_trajectory_corpus

            self.kind = "trajectory"
            examples = load_trajectory_corpus(teacher.trajectory_corpus)
        else:
            if not rollout.prompt_data:
                raise ValueError(f"recipe {training_config.name!r} needs --prompt-data (a JSONL or Parquet file)")
            config = DataConfig(path=rollout.prompt_data, kind="prompt" if self.kind == "prompt" else self.kind,
                                input_key=rollout.input_key, label_key=rollout.label_key,
                                metadata_key=rollout.metadata_key, apply_chat_template=rollout.apply_chat_template,
                                malformed_rows=rollout.malformed_rows)
            examples = load_examples(config, tokenizer)
            check_examples(examples, run_config=run_config, training_config=training_config, kind=self.kind)
        self.loader = EpochLoader(examples, seed=run_config.train.seed)

    def next_examples(self, count: int | None = None) -> list:
        """The next `count` examples (default: one step's rollout_batch_size); dynamic sampling asks for more."""
        return self.loader.next_batch(self.batch_size if count is None else count)

    def next_dataset_batch(self) -> dict[str, list]:
        """A whole step of supervised samples (SFT, DPO pairs or corpus trajectories)."""
        examples = self.next_examples()
        if self.kind == "dpo":
            return dpo_batch(examples)
        if self.kind == "trajectory":
            return sft_batch([row["prompt_ids"] for row in examples], [row["response_ids"] for row in examples],
                             [row["loss_mask"] for row in examples])
        return sft_batch([e.prompt_ids for e in examples], [e.response_ids for e in examples])

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
