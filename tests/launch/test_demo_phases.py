"""The demos' shared phase knobs become the run-config keys of a real run (no training here)."""

from stacx.launch.demo.agent import AgentDemoSettings
from stacx.launch.demo.phases import OnPolicyPhase, demo_run_config
from stacx.launch.demo.pipeline import DemoSettings


def test_sft_and_grpo_phase_knobs_reach_their_run_config_sections(tmp_path):
    settings = DemoSettings(progress_bar=False)
    sft = demo_run_config(settings, str(tmp_path), "sft", settings.sft.run_values())
    assert (sft.train.algorithm, sft.train.num_steps, sft.rollout.rollout_batch_size, sft.optim.lr) == (
        "sft", settings.sft.steps, settings.sft.batch_size, settings.sft.lr)
    grpo = demo_run_config(settings, str(tmp_path), "grpo", settings.grpo.run_values())
    assert (grpo.train.algorithm, grpo.train.num_steps, grpo.rollout.rollout_batch_size,
            grpo.rollout.n_samples_per_prompt, grpo.optim.lr) == (
        "grpo", settings.grpo.steps, settings.grpo.prompts_per_step, settings.grpo.samples_per_prompt, settings.grpo.lr)
    assert grpo.algorithm.use_kl_loss and grpo.algorithm.kl_loss_coef == settings.grpo.kl_coef == 0.001
    assert grpo.logging.out == str(tmp_path / "grpo") and grpo.rollout.rollout_seed == settings.seed


def test_an_on_policy_phase_without_kl_coef_leaves_the_kl_loss_off(tmp_path):
    settings = AgentDemoSettings(progress_bar=False)
    phase = OnPolicyPhase(recipe="opd", steps=3, prompts_per_step=2, samples_per_prompt=2, lr=1e-2)
    config = demo_run_config(settings, str(tmp_path), "opd", {**phase.run_values(), "teacher_url": "http://teacher"})
    assert config.train.algorithm == "opd" and not config.algorithm.use_kl_loss
    assert "use_kl_loss" not in config.algorithm.given_keys


def test_every_long_wait_of_the_demo_says_what_it_waits_for(tmp_path, monkeypatch):
    """The three phases with their training and measuring stubbed out: each held-out pass, the teacher
    server's start and the distillation run are announced by a line before they start."""
    import json

    from stacx.launch.demo import measure, pipeline, report
    from stacx.rollout import teacher
    from stacx.trainer import factory
    from stacx.trainer.cluster.ray import connect

    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text("".join(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n" for _ in range(3)))
    names = ("init", "sft", "grpo", "grpo_run", "student_init", "student")
    monkeypatch.setattr(pipeline, "_prepare", lambda settings, out: {"eval": str(eval_path), "train": "t",
                                                                     **{name: f"/ckpt/{name}" for name in names}})
    monkeypatch.setattr(pipeline, "run_phase", lambda *args, **kwargs: (1.0, 0.5))
    monkeypatch.setattr(pipeline, "train", lambda run_config, graph=None: None)
    monkeypatch.setattr(pipeline, "_save_tokenizer", lambda *args: None)
    monkeypatch.setattr(pipeline, "phase_outputs", lambda *args: {})
    monkeypatch.setattr(pipeline, "TeacherServer", lambda *args: type("Server", (), {"url": "u", "close": lambda s: None})())
    monkeypatch.setattr(teacher, "TeacherClient", lambda url: type("Client", (), {"close": lambda s: None})())
    monkeypatch.setattr(connect, "connect_ray", lambda *args, **kwargs: type("C", (), {"shutdown": lambda s: None})())
    # The phases' one running policy worker (stacx.trainer.factory.create_run_workers), stubbed as the runs are.
    monkeypatch.setattr(factory, "create_run_workers",
                        lambda *args, **kwargs: type("Graph", (), {"ended": None, "shutdown": lambda s: None})())
    monkeypatch.setattr(report, "write_demo_plot", lambda *args, **kwargs: "demo.png")
    monkeypatch.setattr(measure, "load_reference_model", lambda path: path)
    monkeypatch.setattr(measure, "greedy_accuracy", lambda *args, **kwargs: 0.5)
    monkeypatch.setattr(measure, "reverse_kl_to_teacher", lambda *args, **kwargs: 0.1)
    lines: list[str] = []
    pipeline.run_demo(DemoSettings(progress_bar=False, num_eval_prompts=3), str(tmp_path / "out"), log=lines.append)
    text = "\n".join(lines)
    assert text.count("evaluating 3 held-out prompts") == 5  # the start, after SFT, after GRPO, the student twice
    assert text.count("measuring the reverse KL") == 2
    assert "starting `stacx serve` with the GRPO model" in text and "training the student" in text
