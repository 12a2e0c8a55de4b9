"""Inference engines, teacher scoring, rewards, data, environments and tools (agent episodes), DAgger roll-ins.

Imports are light: torch and the standard library only; megatron-core and the models package are
loaded when a CPU engine is built. See docs/rollout.md.
"""

from stacx.rollout.dagger import AggreVaTeRollIn, BetaMixtureRollIn, BetaSchedule, Executor, TMaxSchedule, build_roll_in
from stacx.rollout.engines.base import InferenceEngine
from stacx.rollout.http_client import RetryPolicy, ServerRequestError, ServerUnavailableError
from stacx.rollout.engines.http import HttpEngine
from stacx.rollout.manager import RolloutManager, Sample
from stacx.objectives.distillation import TEACHER_EXECUTED_SENTINEL
from stacx.rollout.teacher import TeacherClient, TeacherScores, TeacherUnavailableError
from stacx.rollout.types import GenerateOutput, GenerateRequest, SamplingParams

__all__ = [
    "AggreVaTeRollIn", "BetaMixtureRollIn", "BetaSchedule", "Executor", "GenerateOutput", "GenerateRequest",
    "HttpEngine", "InferenceEngine", "RetryPolicy", "RolloutManager", "Sample", "SamplingParams",
    "ServerRequestError", "ServerUnavailableError", "TEACHER_EXECUTED_SENTINEL", "TMaxSchedule", "TeacherClient",
    "TeacherScores", "TeacherUnavailableError", "build_roll_in",
]
