"""The old rank 0 of `test_restarts_and_dumps.py`'s save-lock test, in a module of its own: a spawned process
imports only the module its target lives in, and the test module imports torch and the trainer (about 5 s of
CPU in a fresh interpreter), where this one imports the lock alone (0.1 s)."""

from __future__ import annotations


def hold_the_save_lock_until_released(save: str, held, release) -> None:
    """Hold `save`'s lock, set `held`, and keep it until `release` is set (30 s at most)."""
    from stacx.trainer.save_lock import hold_save_folder

    with hold_save_folder(save):
        held.set()
        release.wait(30)
