"""--dump-rollouts then --replay-rollouts, end to end on the torchrun loop (one forked gloo rank, no Ray):
a GRPO run and an OPD run (rollouts from a CPU engine served in this process, teacher log-probs from a
second one) each dump their two steps; the replays train from the dumps with no engine, no teacher and no
reward function given, and their losses, grad norms and final weights equal the originals' bitwise. The
agent run's dump and replay are in test_agent_grpo.py (its multi-turn episodes)."""

from __future__ import annotations

import os

import pytest
import torch

from stacx.testing.distributed import run_distributed
from tests.trainer.training_fixtures import ATTACHED_SERVER_KEY, VARIED_REWARD, read_metrics, run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]

COMPARED = ("policy/loss", "policy/grad_norm")


def dump_and_replay(groups, root: str, recipe: str, engine_url: str, teacher_url: str | None) -> None:
    """In one rank: the original run (dumping), then its replay on a fresh process group."""
    from stacx.testing.distributed import find_free_port
    from stacx.trainer.spmd import run_spmd

    common = dict(train={"algorithm": recipe}, hf_checkpoint=os.path.join(root, "..", "files", "policy"),
                  num_steps=2, rollout_engine="http")
    original = run_config(root, **common, prompt_data=os.path.join(root, "..", "files", "prompts.jsonl"),
                          rollout_urls=[engine_url], teacher_url=teacher_url,
                          **({"reward_fn": VARIED_REWARD} if recipe == "grpo" else {}),
                          dump_rollouts=os.path.join(root, "dump"), save=os.path.join(root, "original"),
                          out=os.path.join(root, "out_original"))
    run_spmd(original)
    os.environ["MASTER_PORT"] = str(find_free_port())  # the first run's teardown destroyed the process group
    replay = run_config(root, **common, replay_rollouts=os.path.join(root, "dump"), save=os.path.join(root, "replay"),
                        out=os.path.join(root, "out_replay"))
    run_spmd(replay)


def assert_replay_equals_original(root: str) -> None:
    from tests.checkpointing.helpers import read_torch_dist_tensors

    original, replay = read_metrics(os.path.join(root, "out_original")), read_metrics(os.path.join(root, "out_replay"))
    assert [row["step"] for row in replay] == [0, 1]
    for name in COMPARED:
        assert [row[name] for row in replay] == [row[name] for row in original], name
    assert any(row["policy/grad_norm"] > 0 for row in original)  # the steps changed the weights
    weights = [read_torch_dist_tensors(os.path.join(root, run, "step_000000002", "roles", "policy", "model"))
               for run in ("original", "replay")]
    assert weights[0].keys() == weights[1].keys() and weights[0]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny policy and teacher files, and a function starting a fresh CPU engine server on one of them."""
    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout
    from stacx.serving.server import EngineHttpServer
    from tests.trainer.training_fixtures import write_tiny_run_files

    base = tmp_path_factory.mktemp("replay")
    files = write_tiny_run_files(str(base / "files"))
    ensure_single_process_layout()
    servers = []

    def serve(name: str):
        server = EngineHttpServer(CpuEngine.from_hf_checkpoint(files[name], seed=0), api_key=ATTACHED_SERVER_KEY).start()
        servers.append(server)
        return server.url

    yield base, serve
    for server in servers:
        server.stop()
    destroy_parallel_layout()


@pytest.mark.parametrize("recipe", ["grpo", "opd"])
def test_a_replayed_dump_trains_to_the_originals_losses_and_weights(served, recipe, monkeypatch):
    base, serve = served
    root = base / recipe
    root.mkdir()
    monkeypatch.setenv("STACX_API_KEY", ATTACHED_SERVER_KEY)
    teacher = serve("teacher") if recipe == "opd" else None
    run_distributed(dump_and_replay, 1, args=(str(root), recipe, serve("policy"), teacher), timeout_s=300)
    assert sorted(os.listdir(root / "dump")) == ["dump.json", "step_000000000.pt", "step_000000001.pt"]
    assert_replay_equals_original(str(root))
    if recipe == "opd":  # the teacher's log-probs came from the dump: the replay had no teacher
        step = torch.load(root / "dump" / "step_000000000.pt", weights_only=True)
        assert len(step["fields"]["teacher_log_probs"]["lengths"]) == 4
