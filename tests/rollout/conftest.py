"""The rollout tests' engine fixtures, from their one home (tests/serving/fixtures.py)."""

from tests.serving.fixtures import cpu_engine, single_process_world, tiny_checkpoints  # noqa: F401  (fixtures, found by name)
