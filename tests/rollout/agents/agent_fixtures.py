"""A tiny served policy for the OpenAI-endpoint tests: a character tokenizer over printable ASCII
whose chat template renders tools and tool calls in the Hermes style, a random tiny llama over
it, and `stacx serve`'s server around the CPU engine."""

from __future__ import annotations

from stacx.wire.engine import InferenceEngine
from stacx.wire.types import GenerateOutput

import string

TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}<eos>{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|assistant|>{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}<eos>"
    "{%- elif message.role == 'tool' %}<|user|>tool: {{ message.content }}<eos>"
    "{%- else %}<|{{ 'system' if message.role == 'developer' else message.role }}|>{{ message.content }}<eos>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""`<|role|>content<eos>` per message (tools listed in a system line, calls as `<tool_call>{json}</tool_call>`)."""

CONTEXT_LENGTH = 2048


def tool_tokenizer():
    from stacx.rollout.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer("".join(dict.fromkeys(string.printable)))
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


def save_policy(path, tokenizer, seed: int = 0) -> str:
    from stacx.models.testing import save_tiny_hf_checkpoint

    save_tiny_hf_checkpoint(path, "llama", seed=seed, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                            max_position_embeddings=CONTEXT_LENGTH)
    tokenizer.save_pretrained(path)
    return str(path)


BASH_TOOL = {"type": "function", "function": {"name": "bash", "description": "run a command",
                                              "parameters": {"type": "object",
                                                             "properties": {"command": {"type": "string"}}}}}


def train_one_grpo_step(server, rollout, out, *, num_tasks: int, n_samples_per_task: int):
    """One GRPO step of the real loop (StacxTrainer over a RoleRuntime in this process, on the served
    checkpoint) whose step rollout is `rollout`; returns (the step's batch, scored by the trainer before
    it trained, the step's metrics). Checks that the trainer's log-probs of every generated id equal the
    engine's (atol 2e-4: fp32 CPU forwards of the same weights, packed vs incremental)."""
    import torch

    from stacx.trainer.cluster.local import LocalRoleGroup, TorchrunChannel
    from stacx.trainer.config.resolve import resolve_algorithm_config
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.loop import StacxTrainer
    from stacx.trainer.recipes import get_recipe
    from stacx.trainer.runtime.role_runtime import RoleRuntime

    training_config = get_recipe("grpo")
    run_config = RunConfig.from_dict({"train": {"algorithm": "grpo"}, "hf_checkpoint": server.model_path, "num_steps": 1,
                                      "rollout_batch_size": num_tasks, "n_samples_per_prompt": n_samples_per_task, "lr": 1e-3,
                                      "out": str(out), "progress_bar": False, "tensorboard": False,
                                      "plots": False}, source="test")
    algorithm = resolve_algorithm_config(training_config, run_config, environ={})
    role = training_config.roles[0]
    runtime = RoleRuntime(role, algorithm, server.engine.groups, model=run_config.model, optim=run_config.optim,
                          train=run_config.train, rank=0)
    trainer = StacxTrainer(run_config=run_config, training_config=training_config, algorithm=algorithm,
                           roles={role.name: LocalRoleGroup(runtime, role.name)}, channel=TorchrunChannel(), data=None,
                           step_rollout=rollout)
    seen = []
    fill = trainer.fill_forward_fields

    def fill_and_score(batch):  # the trainer's log-probs of the batch, before its step changes the weights
        fill(batch)
        scored = batch.select(range(batch.num_samples))
        trainer.role_fields(role.name, scored, ["log_probs"])
        seen.append(scored)

    trainer.fill_forward_fields = fill_and_score
    before = [p.detach().clone() for p in runtime.model.parameters()]
    metrics = trainer.run()
    (batch,) = seen
    for mask, engine_log_probs, trainer_log_probs in zip(batch.loss_masks, batch.rollout_log_probs, batch.log_probs):
        assert 0 < mask.sum() < mask.numel()  # generated ids are trained on, the template's ids between turns are not
        generated = mask.bool()
        torch.testing.assert_close(trainer_log_probs[generated], engine_log_probs[generated], atol=2e-4, rtol=0)
    assert torch.isfinite(torch.tensor(metrics["policy/loss"]))
    metrics["test/weights_changed"] = float(any(not torch.equal(a, b.detach())
                                                for a, b in zip(before, runtime.model.parameters())))
    return batch, metrics, runtime


def engine_weight_buckets(model, groups) -> list[list]:
    """A copy of a model's weights as Hugging Face-named buckets (what a weight push streams)."""
    from stacx.models import iter_hf_weight_buckets

    return [[(name, tensor.detach().clone()) for name, tensor in bucket]  # a bucket may view the parameters
            for bucket in iter_hf_weight_buckets(model, groups, bucket_bytes=1 << 20)]


class ScriptedEngine(InferenceEngine):
    """Answers request k with the k-th id list (an engine's output), each id with `log_prob`; records every
    request's input ids."""

    def __init__(self, turns: list[list[int]], log_prob: float = -0.5):
        self.turns, self.inputs, self.log_prob = turns, [], log_prob

    def generate(self, requests):
        outputs = []
        for request in requests:
            ids = self.turns[len(self.inputs)]
            self.inputs.append(list(request.input_ids))
            outputs.append(GenerateOutput(output_ids=list(ids), output_log_probs=[self.log_prob] * len(ids),
                                          finish_reason="stop"))
        return outputs

    def update_weights(self, buckets, *, version):
        raise NotImplementedError

    def weight_version(self):
        return 0

    def pause(self):
        pass

    def resume(self):
        pass

    def flush_cache(self):
        pass

    def health(self):
        return True
