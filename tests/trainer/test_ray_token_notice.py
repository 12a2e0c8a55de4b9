"""A local Ray cluster keeps token authentication but not Ray's notice that it turned it on."""

from __future__ import annotations

import importlib
import logging

from stacx.trainer.cluster.ray.connect import RAY_AUTH_SETUP_LOGGER, _quiet_token_auth_notice


def test_the_quieted_logger_is_the_one_ray_warns_with():
    module = importlib.import_module(RAY_AUTH_SETUP_LOGGER)
    assert module.logger.name == RAY_AUTH_SETUP_LOGGER
    assert hasattr(module, "_warn_token_auth_enabled")  # the notice this hides


def test_only_the_notice_is_hidden_and_the_level_comes_back(caplog):
    module = importlib.import_module(RAY_AUTH_SETUP_LOGGER)
    with caplog.at_level(logging.WARNING, logger=RAY_AUTH_SETUP_LOGGER):
        level_outside = module.logger.level
        with _quiet_token_auth_notice():
            module._warn_token_auth_enabled()
            module.logger.error("a real authentication error")
        assert module.logger.level == level_outside
        module._warn_token_auth_enabled()
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0] == "a real authentication error"
    assert len(messages) == 2 and messages[1].startswith("Token authentication is enabled")  # outside: shown
