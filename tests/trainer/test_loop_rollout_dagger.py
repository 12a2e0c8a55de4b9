"""Live DAgger roll-ins in the training loop (Ray local cluster, tiny student and teacher servers).

- mixture_dagger_opd, beta 'step' schedule 1 -> 0: step 0 is all teacher, step 1 all student;
- mixture_aggrevate_opd in the multi-turn guess-the-digit environment: every episode's turns are
  student for turns < kappa and teacher after, kappa <= T_max(step);
- online_dagger live: every visited turn becomes an SFT sample labeled by the teacher.
Each run trains 2 steps (1 for online_dagger); every sample is dumped to rollouts.jsonl, and the
test checks the dumps against the roll-in plan, the teacher server (re-scored in-process) and the
loss metrics the policy logged. The three runs share one running policy worker (`create_trainer(...,
graph=)`: each starts as on a fresh one).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.trainer.training_fixtures import (ATTACHED_SERVER_KEY, read_metrics, read_rollout_dumps, run_config,
                                             warm_role_workers, write_tiny_run_files)

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

STUDENT, TEACHER, ENVIRONMENT = 1, 2, 0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dagger_files"))
    paths = write_tiny_run_files(root)
    paths["episodes"] = os.path.join(root, "episodes.jsonl")
    with open(paths["episodes"], "w") as f:
        for target in (2, 5, 7):
            f.write(json.dumps({"prompt": "play", "metadata": {"environment": "guess_number", "max_turns": 3,
                                                                "target": target}}) + "\n")
    return paths


@pytest.fixture(scope="module")
def servers(files):
    """This driver process hosts the teacher server (and fresh student servers per test)."""
    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout
    from stacx.serving.server import EngineHttpServer

    ensure_single_process_layout()
    teacher_engine = CpuEngine.from_hf_checkpoint(files["teacher"], seed=11)
    teacher = EngineHttpServer(teacher_engine).start()
    started = []

    def student():
        server = EngineHttpServer(CpuEngine.from_hf_checkpoint(files["policy"], seed=3), api_key=ATTACHED_SERVER_KEY).start()
        started.append(server)
        return server

    yield {"teacher": teacher, "teacher_engine": teacher_engine, "student": student}
    for server in started + [teacher]:
        server.stop()
    destroy_parallel_layout()


@pytest.fixture(scope="module")
def policy_workers(ray_address):
    """One policy worker (one rank) for the module's three runs."""
    with warm_role_workers("online_dagger") as graph:
        yield graph


def _run(tmp_path, files, servers, graph, **values):
    from stacx.trainer.factory import create_trainer

    student = servers["student"]()
    cfg = run_config(str(tmp_path), hf_checkpoint=files["policy"], rollout_engine="http", rollout_urls=[student.url],
                     teacher_url=servers["teacher"].url, save_rollouts_per_step=100, max_tokens_per_micro_batch=128,
                     **values)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STACX_API_KEY", ATTACHED_SERVER_KEY)  # the driver's key for the attached student server
        last = create_trainer(cfg, graph=graph).run()
    return last, read_metrics(str(tmp_path / "out")), read_rollout_dumps(str(tmp_path / "out"))


def _check_sentinel_and_teacher_scores(rows, teacher_engine):
    """+1.0 exactly on teacher-executed tokens; elsewhere the teacher server's own log-probs."""
    from stacx.wire.types import GenerateRequest, SamplingParams

    for row in rows:
        tokens = row["prompt_ids"] + row["response_ids"]
        request = GenerateRequest(input_ids=tuple(tokens), sampling=SamplingParams(max_new_tokens=0),
                                  logprob_start_len=len(row["prompt_ids"]))
        reference = teacher_engine.generate([request])[0].input_log_probs
        for executor, got, want in zip(row["executors"], row["teacher_log_probs"], reference):
            if executor == TEACHER:
                assert got == 1.0
            else:
                assert got == pytest.approx(want, abs=1e-5) and got <= 0


def _check_loss_metrics_match_executors(metrics_row, rows):
    """The loss's teacher/student token counts are the dumped executors of the loss tokens."""
    teacher_tokens = sum(e == TEACHER and m == 1 for r in rows for e, m in zip(r["executors"], r["loss_mask"]))
    student_tokens = sum(e == STUDENT and m == 1 for r in rows for e, m in zip(r["executors"], r["loss_mask"]))
    assert metrics_row["policy/num_teacher_tokens"] == teacher_tokens
    assert metrics_row["policy/num_student_tokens"] == student_tokens
    frac = teacher_tokens / (teacher_tokens + student_tokens)
    assert metrics_row["policy/teacher_action_frac"] == pytest.approx(frac)
    assert metrics_row["rollin/teacher_token_frac"] == pytest.approx(frac)
    for name in ("policy/ce_mean", "policy/k3_mean", "policy/loss", "policy/grad_norm"):
        assert math.isfinite(metrics_row[name]), name
    if teacher_tokens:
        assert metrics_row["policy/ce_mean"] > 0  # -log pi(teacher token) of an untrained student
    if student_tokens:
        assert metrics_row["policy/k3_mean"] > 0  # two different random models


def test_mixture_dagger_opd_beta_one_then_zero(ray_address, files, servers, policy_workers, tmp_path):
    last, rows, dumps = _run(tmp_path, files, servers, policy_workers, train={"algorithm": "mixture_dagger_opd"},
                             prompt_data=files["prompts"], dagger_beta_schedule="step", dagger_beta_start=1.0,
                             dagger_beta_end=0.0, dagger_beta_iters=1)
    assert [row["step"] for row in rows] == [0, 1]
    assert [row["rollin/beta"] for row in rows] == [1.0, 0.0]
    assert all(len(dumps[s]) == 4 for s in (0, 1))  # 2 prompts x 2 samples
    # beta = 1: the teacher executed every action token; beta = 0: the student did.
    for step, executor in ((0, TEACHER), (1, STUDENT)):
        for row in dumps[step]:
            assert row["metadata"]["turn_executors"] == ["teacher" if executor == TEACHER else "student"]
            assert {e for e, m in zip(row["executors"], row["loss_mask"]) if m} == {executor}
    assert rows[0]["policy/teacher_action_frac"] == 1.0 and rows[1]["policy/teacher_action_frac"] == 0.0
    for step in (0, 1):
        _check_loss_metrics_match_executors(rows[step], dumps[step])
        _check_sentinel_and_teacher_scores(dumps[step], servers["teacher_engine"])
    # The student's rollouts of step 1 came from the weights pushed after step 0.
    assert rows[1]["rollout/weight_version"] == 1.0


def test_mixture_aggrevate_opd_student_leads_kappa_turns(ray_address, files, servers, policy_workers, tmp_path):
    last, rows, dumps = _run(tmp_path, files, servers, policy_workers, train={"algorithm": "mixture_aggrevate_opd"},
                             prompt_data=files["episodes"], rollout_batch_size=3, n_samples_per_prompt=2,
                             dagger_kappa_start=1, dagger_kappa_step=1, dagger_kappa_cap=3)
    assert [row["rollin/t_max"] for row in rows] == [1.0, 2.0]
    kappas = []
    for step in (0, 1):
        assert len(dumps[step]) == 6
        for row in dumps[step]:
            kappa, turns = row["metadata"]["kappa"], row["metadata"]["turn_executors"]
            kappas.append(kappa)
            assert 0 <= kappa <= step + 1
            lead = min(kappa, len(turns))
            assert turns == ["student"] * lead + ["teacher"] * (len(turns) - lead)
            # Token level: the executor of each action (between observations) is its turn's.
            actions, previous = [], ENVIRONMENT
            for executor in row["executors"]:
                if executor != ENVIRONMENT and previous == ENVIRONMENT:
                    actions.append(executor)
                previous = executor
            assert actions == [STUDENT if t == "student" else TEACHER for t in turns]
        _check_loss_metrics_match_executors(rows[step], dumps[step])
        _check_sentinel_and_teacher_scores(dumps[step], servers["teacher_engine"])
    assert len(set(kappas)) > 1  # both student-led and teacher-only episodes happened


def test_online_dagger_live_trains_on_teacher_relabels(ray_address, files, servers, policy_workers, tmp_path):
    """One rollout step split into two optimizer steps (--num-steps-per-rollout 2): the relabeled
    samples, however many the roll-in produced, are trained across the two."""
    last, rows, dumps = _run(tmp_path, files, servers, policy_workers, train={"algorithm": "online_dagger"},
                             prompt_data=files["episodes"], rollout_batch_size=2, n_samples_per_prompt=2, num_steps=1, num_steps_per_rollout=2,
                             dagger_beta_schedule="linear", dagger_beta_start=0.5, dagger_beta_end=0.5)
    samples = dumps[0]
    assert [row["rollout_step"] for row in rows] == [0, 0]  # the rollout's metrics are in its last row
    assert rows[-1]["rollin/relabeled_samples"] == len(samples) == round(rows[-1]["rollin/turns_mean"] * 4)
    assert {row["metadata"]["relabeled_turn_executor"] for row in samples} == {"student", "teacher"}
    for row in samples:  # every trained token is the teacher's
        assert {e for e, m in zip(row["executors"], row["loss_mask"]) if m} == {TEACHER}
    assert math.isfinite(last["policy/loss"]) and last["policy/loss"] > 0
    assert sum(row["policy/num_loss_tokens"] for row in rows) == sum(sum(row["loss_mask"]) for row in samples)
    # A student-executed state's label is a fresh teacher action at that state (prompt = the visited prefix).
    prefixes = [row["prompt_ids"] for row in samples]
    assert len({len(p) for p in prefixes}) > 1
