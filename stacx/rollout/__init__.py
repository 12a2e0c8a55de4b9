"""The driver's side of generation: rollouts, teacher scoring, rewards, data, agent episodes, DAgger roll-ins.

    from stacx.rollout import RolloutManager, SamplingParams, TeacherClient

Rooms: `engines/` (the clients of inference servers, the engine registry, the launchers), `agents/`
(episodes, environments, tools, external agents), `asynchronous/` (the async scheduler and rollout).
What the driver and the server both speak lives in `stacx.wire`; the server process in `stacx.serving`.
Each name is imported on first use, so `import stacx.rollout` loads no module of the package. See docs/rollout.md.
"""

from stacx.lazy_names import lazy_names

_EXPORTS = {
    "stacx.objectives.distillation": ("TEACHER_EXECUTED_SENTINEL",),
    "stacx.rollout.dagger": ("AggreVaTeRollIn", "BetaMixtureRollIn", "BetaSchedule", "TMaxSchedule", "build_roll_in"),
    "stacx.rollout.engines.http": ("HttpEngine",),
    "stacx.rollout.manager": ("RolloutManager",),
    "stacx.rollout.teacher": ("TeacherClient", "TeacherScores", "TeacherUnavailableError"),
    "stacx.wire.engine": ("InferenceEngine",),
    "stacx.wire.http_client": ("RetryPolicy", "ServerRequestError", "ServerUnavailableError"),
    "stacx.wire.sample": ("Executor", "Sample"),
    "stacx.wire.types": ("GenerateOutput", "GenerateRequest", "SamplingParams"),
}
"""Module -> the public names it gives."""

__all__, __getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals())
