"""The server tests' fixtures, from their one home (tests/serving/fixtures.py)."""

from tests.serving.fixtures import (  # noqa: F401  (fixtures, found by name)
    cpu_engine,
    single_process_world,
    taught_policy,
    taught_server,
    tiny_checkpoints,
)
