"""The engine supervisor's settings are the run's `RolloutSection` fields, stated once: an out-of-range flag is
refused when the run config is made (before any engine starts), naming the flag, and the supervisor reads the
section it is given."""

from __future__ import annotations

import pytest

from stacx.rollout.engine_health import attach_supervisor
from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.sections import RolloutSection
from stacx.trainer.config.run import RunConfig


@pytest.mark.parametrize("key, value, message", [
    ("min_live_engines", 0, "--min-live-engines must be >= 1, got 0"),
    ("engine_deadline_s", 0, "--engine-deadline-s must be > 0, got 0.0"),
    ("engine_health_interval_s", -1, "--engine-health-interval-s must be > 0, got -1.0"),
    ("attached_engine_wait_s", -1, "--attached-engine-wait-s must be >= 0, got -1.0"),
])
def test_an_out_of_range_engine_fault_flag_is_refused_when_the_run_config_is_made(key, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        RunConfig.from_dict({key: value}, source="command line")


class Engine:
    def shutdown(self):
        pass


def test_the_supervisor_reads_the_run_section_it_is_given():
    section = RolloutSection(min_live_engines=2, engine_deadline_s=5.0, engine_health_interval_s=0.5,
                             attached_engine_wait_s=7.0)
    pool = EnginePool([Engine(), Engine()], names=["a", "b"])
    try:
        supervisor = attach_supervisor(pool, section, servers=None, connect=lambda url: Engine())
        assert supervisor.settings is section and pool.supervisor is supervisor
    finally:
        pool.shutdown()
