"""Roll-in settings checked before any worker starts."""

from __future__ import annotations

import pytest

from stacx.rollout.rollin import check_supported
from stacx.trainer.config.run import RunConfig
from stacx.trainer.recipes import get_recipe


def test_bad_rollin_settings_are_refused_before_any_worker_starts():
    # Live roll-ins run (tests/trainer/test_loop_rollout_dagger.py); a bad schedule or mode fails at start.
    check_supported(get_recipe("mixture_dagger_opd"), RunConfig())
    check_supported(get_recipe("online_dagger"), RunConfig())
    with pytest.raises(ValueError, match="dagger_beta_start"):
        check_supported(get_recipe("mixture_dagger_opd"), RunConfig.from_dict({"dagger_beta_start": 1.5}))
    with pytest.raises(ValueError, match="dagger_sampling_mode"):
        check_supported(get_recipe("mixture_aggrevate_opd"), RunConfig.from_dict({"dagger_sampling_mode": "gamma"}))
