"""A reward given to `stacx train` by file (`--reward-fn tests/launch/constant_reward.py:quarter`),
not importable as a module: tests/launch/test_custom_code_on_every_rank.py."""


def quarter(response, label, metadata=None):
    """0.25 for every response, so the run's mean reward shows which function scored it."""
    return 0.25
