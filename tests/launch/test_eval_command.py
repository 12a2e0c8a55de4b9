"""`stacx eval`: a finished checkpoint (Hugging Face folder or a training step) evaluated outside training.

The end-to-end case checks the numbers against an independent reference: the labels of half the
held-out rows are the greedy answers of the same checkpoint under `transformers`, the other half
are wrong, so greedy pass@1 must be exactly 0.5, for the folder and for the training step holding it.
"""

from __future__ import annotations

import json

import pytest

from stacx.launch.cli import main
from stacx.tasks import write_tiny_checkpoint
from stacx.tasks.builtin import get_task
from stacx.tasks.data import task_rows


def test_flag_mistakes_are_named_before_any_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cases = [
        (["eval", "--task", "sorting"], "give the model to evaluate: --hf-checkpoint FOLDER or --load"),
        (["eval", "--hf-checkpoint", "ckpt", "--task", "sorting", "--eval-data", "x.jsonl"],
         "give exactly one of --eval-data FILE and --task NAME (got both"),
        (["eval", "--hf-checkpoint", "ckpt"], "give exactly one of --eval-data FILE and --task NAME"),
        (["eval", "--hf-checkpoint", "ckpt", "--task", "sorting", "--n-samples", "0"], "--n-samples must be >= 1, got 0"),
        (["eval", "--hf-checkpoint", "ckpt", "--task", "sorting", "--temperature", "-1"], "--temperature must be >= 0"),
        (["eval", "--hf-checkpoint", "ckpt", "--task", "sorting", "--role", "policy"], "--role selects a role of a --load"),
        (["eval", "--hf-checkpoint", "outputs/missing", "--task", "sorting"],
         "--hf-checkpoint outputs/missing: folder not found"),
        (["eval", "--load", "outputs/run/checkpoints", "--task", "sorting"], "--load outputs/run/checkpoints: folder not found"),
        (["eval", "--hf-checkpoint", "ckpt", "--eval-data", "nope.jsonl"], "--eval-data nope.jsonl: file not found"),
        (["eval", "--hf-checkpoint", "ckpt", "--task", "sortin"], "--task: prompt data 'builtin:sortin/eval'"),
        (["eval", "--hf-checkpoint", "ckpt", "--task", "sorting", "--reward-fn", "exact"],
         "--reward-fn: reward_fn 'exact' is neither a built-in"),
        # An --out that cannot be written is named before the evaluation, not after it.
        (["eval", "--hf-checkpoint", "ckpt", "--task", "sorting", "--out", "ckpt"], "--out ckpt: is a folder"),
        (["eval", "--hf-checkpoint", "ckpt", "--task", "sorting", "--out", "ckpt/config.json/eval.json"],
         "--out ckpt/config.json/eval.json: cannot write into"),
    ]
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    for argv, message in cases:  # (how fast a missing folder fails: tests/models/test_checkpoint_path.py)
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv


def _rows_half_matching_the_reference_greedy_answer(checkpoint: str, path) -> None:
    from stacx.launch.demo import measure
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    rows = task_rows(get_task("sorting"), "eval")[:8]
    prompts = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows]
    responses, _ = measure.generate(measure.load_reference_model(checkpoint), prompts,
                                    max_new_tokens=get_task("sorting").max_answer_chars + 1,
                                    eos_token_id=tokenizer.eos_token_id)
    with open(path, "w") as handle:
        for index, (row, response) in enumerate(zip(rows, responses)):
            answer = tokenizer.decode(response, skip_special_tokens=True).strip()
            label = answer if index % 2 == 0 else answer + "#"  # '#' is never generated: a wrong label
            handle.write(json.dumps({"prompt": row["prompt"], "label": label}) + "\n")


def _step_folder_holding(checkpoint: str, root) -> str:
    from tests.checkpointing.helpers import write_training_checkpoint

    return write_training_checkpoint(checkpoint, root / "checkpoints", 5, recipe="grpo")


def test_eval_of_a_folder_and_of_a_training_step_matches_the_reference(tmp_path, capsys):
    checkpoint = write_tiny_checkpoint(str(tmp_path / "ckpt"), "sorting", seed=3)
    data = tmp_path / "eval.jsonl"
    _rows_half_matching_the_reference_greedy_answer(checkpoint, data)

    out = tmp_path / "reports" / "folder.json"
    assert main(["eval", "--hf-checkpoint", checkpoint, "--eval-data", str(data), "--max-new-tokens", "6",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["metrics"]["eval/pass@1"] == pytest.approx(0.5)
    assert report["metrics"]["eval/mean_reward"] == pytest.approx(0.5)
    assert report["num_prompts"] == 8 and len(report["samples"]) == 8
    assert [sample["reward"] for sample in report["samples"]] == [1.0, 0.0] * 4
    assert '"eval/pass@1": 0.5' in printed and str(out) in printed

    step = _step_folder_holding(checkpoint, tmp_path / "run")
    out = tmp_path / "reports" / "step.json"
    assert main(["eval", "--load", str(tmp_path / "run" / "checkpoints"), "--eval-data", str(data),
                 "--max-new-tokens", "6", "--n-samples", "2", "--temperature", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["checkpoint"] == f"{step} (role policy)"
    assert report["metrics"]["eval/pass@1"] == pytest.approx(0.5)
    assert report["metrics"]["eval/pass@2"] == pytest.approx(0.5)  # greedy: both samples agree


def test_rows_without_labels_are_refused_when_the_reward_needs_them(tmp_path, capsys):
    """It exited 0 with a mean reward of 0."""
    import json

    from stacx.launch.cli import main
    from stacx.tasks import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(str(tmp_path / "ckpt"), "addition")
    data = tmp_path / "unlabeled.jsonl"
    data.write_text(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n")
    code = main(["eval", "--hf-checkpoint", checkpoint, "--eval-data", str(data), "--max-new-tokens", "4",
                 "--out", str(tmp_path / "report.json")])
    err = capsys.readouterr().err
    assert code == 2 and "1 of 2 rows" in err and "unlabeled.jsonl:2" in err and "--label-key" in err
    assert not (tmp_path / "report.json").exists()


def test_the_default_response_budget_fits_the_models_context():
    from types import SimpleNamespace

    from stacx.launch.commands.eval import DEFAULT_MAX_NEW_TOKENS, default_response_budget

    prompts = [SimpleNamespace(prompt_ids=[1] * 6), SimpleNamespace(prompt_ids=[1] * 10)]
    assert default_response_budget(prompts, 64) == 54  # a demo model: 64 tokens of context
    assert default_response_budget(prompts, 4096) == DEFAULT_MAX_NEW_TOKENS
    assert default_response_budget(prompts, None) == DEFAULT_MAX_NEW_TOKENS
    assert default_response_budget(prompts, 8) == 1
