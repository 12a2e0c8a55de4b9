"""What the demo measures before and after each phase, with `transformers` as an independent reference.

- `greedy_accuracy`: exact-match accuracy of greedy answers on held-out prompts.
- `reverse_kl_to_teacher`: per-token reverse KL(student || teacher) on the student's own samples,
  the quantity on-policy distillation minimizes, estimated as
      KL ~= sum_{i,t} (log p_student(a_it) - log p_teacher(a_it)) / sum_i R_i
  over responses a_i ~ p_student (temperature 1), with the teacher's log-probs from the
  teacher server (`stacx serve`) and R_i the response length including <eos>.

Checkpoints are read with `transformers` (not Stacx's megatron model), so the numbers do not
depend on the code being trained. Prompts are decoded in batches of equal length (no padding).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch


def load_reference_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _by_length(prompts: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        groups[len(prompt)].append(index)
    return groups


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_id: int,
             temperature: float = 0.0, seed: int = 0) -> tuple[list[list[int]], list[list[float]]]:
    """Responses (up to and including <eos>) and their log-probs at temperature 1 of the sampling
    distribution; temperature 0 is greedy. Returns (response ids, response log-probs) per prompt."""
    generator = torch.Generator().manual_seed(seed)
    responses: list[list[int]] = [[] for _ in prompts]
    log_probs: list[list[float]] = [[] for _ in prompts]
    for indices in _by_length(prompts).values():
        tokens = torch.tensor([list(prompts[i]) for i in indices], dtype=torch.long)  # [B, P]
        done = torch.zeros(len(indices), dtype=torch.bool)
        for _ in range(max_new_tokens):
            logits = model(tokens).logits[:, -1].double()  # [B, V]
            if temperature > 0:
                step_log_probs = torch.log_softmax(logits / temperature, -1)
                chosen = torch.multinomial(step_log_probs.exp(), 1, generator=generator)[:, 0]
            else:
                step_log_probs = torch.log_softmax(logits, -1)
                chosen = logits.argmax(-1)
            for row, index in enumerate(indices):
                if not done[row]:
                    responses[index].append(int(chosen[row]))
                    log_probs[index].append(float(step_log_probs[row, chosen[row]]))
            done |= chosen == eos_token_id
            if bool(done.all()):
                break
            tokens = torch.cat([tokens, chosen[:, None]], dim=1)
    return responses, log_probs


def greedy_accuracy(model, tokenizer, rows: Sequence[dict], *, max_new_tokens: int) -> float:
    """Fraction of rows whose greedy answer (text before <eos>) equals row['label'] exactly."""
    prompts = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows]
    responses, _ = generate(model, prompts, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    correct = 0
    for row, response in zip(rows, responses):
        answer = response[:-1] if response and response[-1] == tokenizer.eos_token_id else response
        correct += tokenizer.decode(answer, skip_special_tokens=True).strip() == str(row["label"]).strip()
    return correct / len(rows)


def reverse_kl_to_teacher(model, tokenizer, rows: Sequence[dict], teacher, *, max_new_tokens: int,
                          num_samples: int = 2, seed: int = 0) -> float:
    """Per-token reverse KL(student || teacher) on student samples (module docstring); `teacher`
    is a `stacx.rollout.teacher.TeacherClient`."""
    prompts = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows] * num_samples
    responses, student_log_probs = generate(model, prompts, max_new_tokens=max_new_tokens,
                                            eos_token_id=tokenizer.eos_token_id, temperature=1.0, seed=seed)
    scores = teacher.score([list(p) + r for p, r in zip(prompts, responses)], [len(r) for r in responses])
    total, count = 0.0, 0
    for student, scored in zip(student_log_probs, scores):
        teacher_log_probs = scored.log_probs.double().tolist()
        assert len(teacher_log_probs) == len(student)
        total += sum(s - t for s, t in zip(student, teacher_log_probs))
        count += len(student)
    return total / count
