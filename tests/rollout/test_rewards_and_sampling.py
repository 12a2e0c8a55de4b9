"""Reward verifiers and containment, dynamic sampling, environment-variable overrides."""

import pytest

from stacx.rollout.dynamic_sampling import collect_informative_groups, is_informative
from stacx.env_overrides import apply_env_overrides, read_env_overrides
from stacx.rollout.rewards import batched_reward, compute_rewards, extract_math_answer, resolve_reward_fn
from stacx.trainer.config.run import TeacherSection


def raising_reward(response, label, metadata):
    if response == "boom":
        raise ZeroDivisionError("bad sample")
    return 1.0


def test_builtin_verifiers():
    assert resolve_reward_fn("exact_match")(" 42 ", "42", {}) == 1.0
    math = resolve_reward_fn("math")
    assert math(r"so \boxed{1/2}", "0.5", {}) == 1.0
    assert math("the answer is 12, then 13", "13", {}) == 1.0
    assert math("the answer is 12", "13", {}) == 0.0
    assert math("no number", "13", {}) == 0.0
    assert extract_math_answer(r"\boxed{3} and 4") == "3"
    assert resolve_reward_fn("format")(r"\boxed{x}", None, {}) == 1.0
    assert resolve_reward_fn("format")("x", None, {"format_regex": r"^\d+$"}) == 0.0


def test_reward_that_raises_is_contained():
    fn = resolve_reward_fn(f"{__name__}:raising_reward")
    results = compute_rewards(fn, ["ok", "boom", "ok"], [0, 0, 0], max_workers=2, failure_reward=-1.0)
    assert [r.reward for r in results] == [1.0, -1.0, 1.0]
    assert results[1].error.startswith("ZeroDivisionError: bad sample") and results[0].error is None

    @batched_reward
    def broken_batch(responses, labels, metadatas):
        raise RuntimeError("down")

    results = compute_rewards(broken_batch, ["a", "b"], [0, 0])
    assert [r.reward for r in results] == [0.0, 0.0] and all("RuntimeError: down" in r.error for r in results)


def test_reward_fn_resolution_errors():
    with pytest.raises(ValueError, match="neither a built-in"):
        resolve_reward_fn("nope")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no callable"):
        resolve_reward_fn(f"{__name__}:missing")


def test_dynamic_sampling_drops_uniform_groups_and_refills():
    assert not is_informative([1.0, 1.0, 1.0]) and is_informative([0.0, 1.0])
    stream = iter([[1, 1], [0, 1], [0, 0], [1, 0], [0, 1], [1, 1], [0, 1]])
    asked = []

    def generate(k):
        asked.append(k)
        return [next(stream) for _ in range(k)]

    result = collect_informative_groups(generate, lambda g: g, target_groups=3, over_sampling_factor=1.0)
    assert result.groups == [[0, 1], [1, 0], [0, 1]]
    assert asked == [3, 2] and result.num_dropped == 2
    with pytest.raises(RuntimeError, match="only 0 of 2 groups"):
        collect_informative_groups(lambda k: [[1, 1]] * k, lambda g: g, target_groups=2, max_rounds=2)


def test_env_overrides():
    env = {"STACX_DISTILL_KL_MODE": "topk", "STACX_DAGGER_SAMPLING_MODE": "mixture_aggrevate_opd",
           "STACX_DAGGER_SFT_MODE": "trajectory"}
    section = apply_env_overrides(TeacherSection(), env)
    assert (section.distill_kl_mode, section.dagger_sampling_mode, section.dagger_sft_mode) == ("topk", "kappa", "trajectory")
    assert apply_env_overrides(TeacherSection(), {}) == TeacherSection()
    with pytest.raises(ValueError, match="STACX_DISTILL_KL_MODE='forward'"):
        read_env_overrides({"STACX_DISTILL_KL_MODE": "forward"})


def test_pass_at_k_and_evaluate_with_a_scripted_engine(tmp_path):
    import json
    from itertools import count

    from stacx.rollout.data import Example
    from stacx.rollout.evaluation import RolloutDumper, evaluate, pass_at_k
    from stacx.rollout.manager import RolloutManager
    from stacx.rollout.types import GenerateOutput, SamplingParams

    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(3, 0, 2) == 0.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    answers = count()

    class Scripted:  # answers "1" to the first request only, "0" afterwards
        def generate(self, requests):
            return [GenerateOutput(output_ids=[7 if next(answers) == 0 else 6], output_log_probs=[-0.1]) for _ in requests]

    class Digits:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(str(i - 6) for i in ids)

    manager = RolloutManager(Scripted(), tokenizer=Digits(), reward_fn="exact_match")
    examples = [Example(prompt_ids=[1], source="a", label="1"), Example(prompt_ids=[2], source="b", label="1")]
    metrics = evaluate(manager, examples, SamplingParams(max_new_tokens=1), n_samples=2)
    assert metrics == {"eval/mean_reward": 0.25, "eval/reward_errors": 0.0, "eval/pass@1": 0.25, "eval/pass@2": 0.5}
    samples = manager.generate([[1]], SamplingParams(max_new_tokens=1), n_samples_per_prompt=3, labels=["0"])
    RolloutDumper(str(tmp_path), per_step=2).write(5, samples)
    rows = [json.loads(line) for line in open(tmp_path / "rollouts.jsonl")]
    assert len(rows) == 2 and rows[0]["step"] == 5 and rows[0]["reward"] == 1.0


REWARD_FILE = '''
from stacx import register_reward


def length_reward(response, label, metadata=None):
    return float(len(response))


@register_reward("file_registered_reward", needs_label=True)
def registered(response, label, metadata=None):
    return float(response == label)
'''


def test_reward_fn_accepts_a_file_path_and_a_reward_the_file_registers(tmp_path):
    """`--reward-fn my_reward.py:fn` was refused with `No module named 'my_reward'`."""
    from stacx.plugins import discovery
    from stacx.rollout.rewards import REWARD_FUNCTIONS

    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    try:
        fn = resolve_reward_fn(f"{path}:length_reward")
        assert fn("abcd", None, {}) == 4.0
        # The file is imported once: its @register_reward name is then known (and needs its label).
        assert resolve_reward_fn(f"{path}:length_reward") is fn
        assert resolve_reward_fn("file_registered_reward")("3", "3", {}) == 1.0
        assert REWARD_FUNCTIONS["file_registered_reward"].needs_label
        # Rewards run in the driver: the file is not shipped to the role workers.
        assert not any(entry.origin == str(path) for entry in discovery.user_module_sources())
        with pytest.raises(ValueError, match=r"'length_rewrd'; did you mean 'length_reward'\?"):
            resolve_reward_fn(f"{path}:length_rewrd")
        with pytest.raises(ValueError, match=r"--reward-fn '.*missing.py': no such file"):
            resolve_reward_fn(f"{tmp_path / 'missing.py'}:f")
        with pytest.raises(ValueError, match=r"did you mean 'exact_match'\?"):
            resolve_reward_fn("exact_mach")
    finally:
        REWARD_FUNCTIONS.pop("file_registered_reward", None)
