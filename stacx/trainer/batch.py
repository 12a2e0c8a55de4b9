"""The step batch: what one step trains on, where it comes from, and how it is cut into micro-batches.

    batch = StepBatch.from_samples(samples)            # a rollout (or StepDataSource.next_dataset_batch())
    batch.ref_log_probs = ...; batch.advantages = ...   # forward-only fields, the advantage estimator
    plan = plan_micro_batches(batch, dp_size=..., cp_size=..., max_tokens_per_micro_batch=...)
    shard = [batch.select(indices) for indices in plan[dp_rank]]          # what a rank receives
    micro_batch = shard[0].pack(groups)                                    # a MicroBatch, on the rank

`StepBatch` holds one documented attribute per field (`SampleFields`, shared with the
`MicroBatch` a specialization receives, plus the step-level `tokens`, `response_lengths`,
`rewards`, `prompt_id`), so every role and the advantage estimators read each field under one name.

Sources (`StepDataSource`):
- rollout recipes: prompts (`rollout.prompt_data`, kind 'prompt') in a resumable epoch order;
- 'dataset' recipes: SFT rows (prompt + response) or DPO rows (prompt, chosen, rejected);
- online_dagger with `dagger_sft_mode: trajectory`: SFT on a saved teacher corpus.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Optional, Sequence

import torch

from stacx.parallel.cp_layout import round_up
from stacx.parallel.groups import ProcessGroups
from stacx.parallel.packing import pack_micro_batches
from stacx.specializations.batch import MicroBatch, SampleFields
from stacx.specializations.dpo import DPOSpecialization

__all__ = ["MicroBatch", "StepBatch", "StepDataSource", "data_kind", "plan_micro_batches"]


@dataclass(kw_only=True)
class StepBatch(SampleFields):
    """One step's samples (or one rank's share of them): per-sample lists, one attribute per field."""

    tokens: list[torch.Tensor]
    """[L_i] int64 per sample: prompt then response."""
    response_lengths: list[int]
    """R_i per sample (the prompt is the first L_i - R_i >= 1 tokens)."""
    rewards: Optional[list[float]] = None
    """One scalar reward per sample (rollout recipes; shaped by teacher_kl_coef in opd_rl)."""
    prompt_id: Optional[list[int]] = None
    """The prompt (group) each sample was drawn for: the group key of group-relative advantages."""
    episode_id: Optional[list[Optional[int]]] = None
    """The episode each sample is a trajectory of, when an episode gave several (a branched agent session):
    group-relative advantages count each episode once. None when every sample is its own episode."""

    # ---- building -------------------------------------------------------------------------

    @classmethod
    def from_samples(cls, samples: Sequence[Any]) -> "StepBatch":
        """Rollout samples (`stacx.wire.sample.Sample`) -> a step batch; teacher fields when every sample has them."""
        batch = cls(
            tokens=[torch.tensor(s.tokens, dtype=torch.long) for s in samples],
            response_lengths=[s.response_length for s in samples],
            loss_masks=[torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples],
            rollout_log_probs=[torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples],
            executors=[torch.tensor(s.executors, dtype=torch.long) for s in samples],
            rewards=[float(s.reward) if s.reward is not None else 0.0 for s in samples],
            prompt_id=[s.group_index for s in samples],
            episode_id=[s.episode_id for s in samples] if any(s.episode_id is not None for s in samples) else None,
        )
        if samples and all(s.teacher_log_probs is not None for s in samples):
            batch.teacher_log_probs = [torch.tensor(s.teacher_log_probs, dtype=torch.float32) for s in samples]
        routed = [s.routed_experts is not None for s in samples]
        if any(routed) and not all(routed):
            raise ValueError(f"--use-routing-replay: {routed.count(False)} of {len(samples)} samples carry no routed "
                             "experts (multi-turn environment episodes, DAgger roll-ins and --agent rollouts do not "
                             "return them yet); drop --use-routing-replay for this run")
        if samples and all(routed):
            batch.routed_experts = [s.routed_experts for s in samples]
        if samples and all(s.teacher_top_log_probs is not None for s in samples):
            batch.teacher_top_log_probs = [s.teacher_top_log_probs for s in samples]
            batch.teacher_top_ids = [s.teacher_top_ids for s in samples]
        return batch

    @classmethod
    def supervised(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   loss_masks: Sequence[Sequence[int]] | None = None) -> "StepBatch":
        """Supervised samples: tokens = prompt + response, loss on the response (or the given masks)."""
        batch = cls(tokens=[], response_lengths=[], loss_masks=[])
        for index, (prompt, response) in enumerate(zip(prompts, responses)):
            if not prompt or not response:
                raise ValueError(f"SFT sample {index} needs a non-empty prompt and response")
            batch.tokens.append(torch.tensor(list(prompt) + list(response), dtype=torch.long))
            batch.response_lengths.append(len(response))
            mask = loss_masks[index] if loss_masks is not None else [1] * len(response)
            batch.loss_masks.append(torch.tensor(mask, dtype=torch.float32))
        return batch

    @classmethod
    def preference_pairs(cls, examples: Sequence[Any]) -> "StepBatch":
        """DPO pairs as two samples each: chosen (is_chosen=1) then rejected, sharing a pair id."""
        prompts, responses, pair_ids, is_chosen = [], [], [], []
        for pair, example in enumerate(examples):
            for chosen, response in ((1, example.chosen_ids), (0, example.rejected_ids)):
                prompts.append(example.prompt_ids)
                responses.append(response)
                pair_ids.append(pair)
                is_chosen.append(chosen)
        return replace(cls.supervised(prompts, responses), pair_ids=pair_ids, is_chosen=is_chosen)

    # ---- cutting ----------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return len(self.tokens)

    def select(self, indices: Sequence[int]) -> "StepBatch":
        """The sub-batch of samples `indices` (every set per-sample field, in that order)."""
        picked = {f.name: [value[i] for i in indices] for f in fields(self)
                  if (value := getattr(self, f.name)) is not None}
        return StepBatch(**picked)

    def packing_units(self) -> list[list[int]]:
        """Groups of samples that must share a micro-batch: DPO pairs, else single samples."""
        if self.pair_ids is None:
            return [[i] for i in range(self.num_samples)]
        units: dict[Any, list[int]] = {}
        for index, pair in enumerate(self.pair_ids):
            units.setdefault(pair, []).append(index)
        return list(units.values())

    def pack(self, groups: ProcessGroups | None = None) -> MicroBatch:
        """This (sub-)batch as one packed `MicroBatch` for a rank with ProcessGroups `groups`."""
        sample_fields = {name: value for name, value in self.per_sample_fields()}
        return MicroBatch.pack(self.tokens, self.response_lengths, groups=groups, **sample_fields)


def plan_micro_batches(batch: StepBatch, *, dp_size: int, cp_size: int, max_tokens_per_micro_batch: int,
                       pp_size: int = 1, interleaved: bool = False) -> list[list[list[int]]]:
    """[dp_rank][micro_batch] -> sample indices, balanced by tokens, same micro-batch count per rank.

    With pipeline parallelism each rank gets at least `pp_size` micro-batches when it has that many
    samples: a pipeline of P stages idles (P - 1) / (M + P - 1) of a step with M micro-batches, so
    fewer than P leaves stages waiting for most of the step (docs/parallel.md, "Pipeline parallel").
    `interleaved` (virtual pipeline stages): megatron's interleaved schedule runs micro-batches in groups
    of P, so the count is a multiple of P (ValueError when a rank has fewer than P samples).
    """
    units = batch.packing_units()
    if len(units) < dp_size:
        raise ValueError(f"the step has {len(units)} samples (or pairs) for {dp_size} data-parallel ranks; "
                         "raise rollout_batch_size / n_samples_per_prompt or lower data_parallel_size")
    pad = 2 * cp_size if cp_size > 1 else 1
    lengths = [sum(round_up(int(batch.tokens[i].shape[0]), pad) for i in unit) for unit in units]
    longest = max(lengths)
    if longest > max_tokens_per_micro_batch:
        raise ValueError(f"a sample (or pair) of {longest} tokens exceeds max_tokens_per_micro_batch="
                         f"{max_tokens_per_micro_batch}")
    multiple = pp_size if interleaved and pp_size > 1 else 1
    if len(units) // dp_size < multiple:
        raise ValueError(f"the step has {len(units)} samples (or pairs) for {dp_size} data-parallel ranks; the "
                         f"interleaved schedule (--num-layers-per-virtual-pipeline-stage) needs at least "
                         f"--pipeline-model-parallel-size {pp_size} per rank: raise --global-batch-size or unset "
                         "--num-layers-per-virtual-pipeline-stage")
    plan = pack_micro_batches(lengths, dp_size=dp_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                              min_micro_batches=max(1, min(pp_size, len(units) // dp_size)),
                              micro_batch_multiple=multiple)
    per_rank = [[[i for unit in mb for i in units[unit]] for mb in rank] for rank in plan.micro_batches]
    for rank, micro_batches in enumerate(per_rank):
        if any(not mb for mb in micro_batches):
            raise ValueError(f"data-parallel rank {rank} got an empty micro-batch; the step has too few samples")
    return per_rank


def data_kind(training_config) -> str:
    """'prompt' for rollout recipes, 'dpo' for preference recipes, else 'sft'."""
    if training_config.data_source == "rollout":
        return "prompt"
    role = training_config.trainable_roles[0]
    return "dpo" if issubclass(role.specialization_cls, DPOSpecialization) else "sft"


class StepDataSource:
    """Examples for each step in a deterministic, checkpointable epoch order."""

    def __init__(self, run_config, training_config, tokenizer):
        # Imported here: the data readers (Parquet, tokenizer templates) and the run checks (which import the
        # rollout stack) load only on the driver, not in every role worker that imports this module.
        from stacx.rollout.data import DataConfig, EpochLoader, load_examples, load_trajectory_corpus
        from stacx.env_overrides import apply_env_overrides
        from stacx.trainer.config.checks import check_examples

        rollout = run_config.rollout
        self.kind = data_kind(training_config)
        self.batch_size = rollout.rollout_batch_size
        teacher = apply_env_overrides(run_config.teacher)  # STACX_DAGGER_SFT_MODE picks replay or live
        if training_config.rollin_protocol == "teacher_relabel" and teacher.dagger_sft_mode == "trajectory":
            if not teacher.trajectory_corpus:
                raise ValueError("dagger_sft_mode 'trajectory' needs --trajectory-corpus")
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

    def next_dataset_batch(self) -> StepBatch:
        """A whole step of supervised samples (SFT, DPO pairs or corpus trajectories)."""
        examples = self.next_examples()
        if self.kind == "dpo":
            return StepBatch.preference_pairs(examples)
        if self.kind == "trajectory":
            return StepBatch.supervised([row["prompt_ids"] for row in examples],
                                        [row["response_ids"] for row in examples],
                                        [row["loss_mask"] for row in examples])
        return StepBatch.supervised([e.prompt_ids for e in examples], [e.response_ids for e in examples])

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    @property
    def prompt_index(self) -> int:
        """Index of the next example in the run's data order, counted across epochs (epoch x N + position)."""
        return self.loader.epoch * len(self.loader.examples) + self.loader.position

    def state_at(self, prompt_index: int) -> dict:
        """The `state_dict` of this source positioned at example `prompt_index` of the data order."""
        epoch, position = divmod(prompt_index, len(self.loader.examples))
        return {**self.loader.state_dict(), "epoch": epoch, "position": position}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

