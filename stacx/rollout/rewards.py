"""Reward functions: built-in verifiers, custom ones by import path, batched and contained.

A reward function takes one sample and returns a float:

    def my_reward(response: str, label, metadata: dict) -> float

or, marked with `@batched_reward`, lists of each argument and returns a list of floats.
`compute_rewards` runs them concurrently; an exception in a reward function marks that sample
(`RewardResult.error`, reward = `failure_reward`) and is logged, it never crashes the run.
"""

from __future__ import annotations

import importlib
import logging
import re
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, Any, dict], float]
REWARD_FUNCTIONS: dict[str, RewardFn] = {}


def register_reward(name: str):
    """Decorator: register a reward function under `name` (duplicates are rejected)."""

    def decorator(fn):
        if name in REWARD_FUNCTIONS:
            raise ValueError(f"reward function {name!r} is already registered")
        REWARD_FUNCTIONS[name] = fn
        return fn

    return decorator


def batched_reward(fn):
    """Mark `fn(responses, labels, metadatas) -> list[float]` as taking whole batches."""
    fn.batched = True
    return fn


def resolve_reward_fn(spec: str) -> RewardFn:
    """A registered name (e.g. 'exact_match') or an import path 'package.module:function'."""
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if ":" not in spec:
        raise ValueError(f"reward_fn {spec!r} is neither a built-in ({sorted(REWARD_FUNCTIONS)}) nor 'module:function'")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward_fn {spec!r}: cannot import module {module_name!r}: {err}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


# ---- built-in verifiers ------------------------------------------------------------------------

@register_reward("exact_match")
def exact_match(response: str, label, metadata: Optional[dict] = None) -> float:
    """1.0 if the stripped response equals the stripped label, else 0.0."""
    return float(response.strip() == str(label).strip())


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def extract_math_answer(text: str) -> Optional[str]:
    """The last \\boxed{...} content, else the last number in the text, else None."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Optional[Fraction]:
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


@register_reward("math")
def math_answer(response: str, label, metadata: Optional[dict] = None) -> float:
    """1.0 if the extracted answer equals the label numerically (exactly as a fraction), or as a string."""
    answer = extract_math_answer(response)
    if answer is None:
        return 0.0
    expected = extract_math_answer(str(label)) or str(label)
    a, b = _as_number(answer), _as_number(expected)
    if a is not None and b is not None:
        return float(a == b)
    return float(answer.strip() == expected.strip())


@register_reward("format")
def format_reward(response: str, label, metadata: Optional[dict] = None) -> float:
    """1.0 if the response matches metadata['format_regex'] (default: contains a \\boxed{} answer)."""
    pattern = (metadata or {}).get("format_regex", r"\\boxed\{[^{}]*\}")
    return float(re.search(pattern, response, flags=re.DOTALL) is not None)


# ---- running them ------------------------------------------------------------------------------

@dataclass
class RewardResult:
    reward: float
    error: Optional[str] = None
    """The exception (type, message and last traceback line) when the reward function raised."""


def compute_rewards(
    reward_fn: RewardFn,
    responses: Sequence[str],
    labels: Sequence[Any],
    metadatas: Optional[Sequence[dict]] = None,
    *,
    max_workers: int = 8,
    failure_reward: float = 0.0,
) -> list[RewardResult]:
    """Rewards for every sample; failures are contained per sample (or per batch if batched)."""
    metadatas = list(metadatas) if metadatas is not None else [{} for _ in responses]
    if not len(responses) == len(labels) == len(metadatas):
        raise ValueError(f"compute_rewards: {len(responses)} responses, {len(labels)} labels, {len(metadatas)} metadatas")

    def describe(err: BaseException) -> str:
        where = traceback.extract_tb(err.__traceback__)[-1]
        return f"{type(err).__name__}: {err} (at {where.filename}:{where.lineno})"

    if getattr(reward_fn, "batched", False):
        try:
            values = list(reward_fn(list(responses), list(labels), metadatas))
            if len(values) != len(responses):
                raise ValueError(f"batched reward returned {len(values)} values for {len(responses)} samples")
            return [RewardResult(float(v)) for v in values]
        except Exception as err:
            logger.error("batched reward function failed for %d samples: %s", len(responses), describe(err))
            return [RewardResult(failure_reward, describe(err)) for _ in responses]

    def one(i: int) -> RewardResult:
        try:
            return RewardResult(float(reward_fn(responses[i], labels[i], metadatas[i])))
        except Exception as err:
            logger.error("reward function failed on sample %d: %s", i, describe(err))
            return RewardResult(failure_reward, describe(err))

    if max_workers <= 1 or len(responses) <= 1:
        return [one(i) for i in range(len(responses))]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(responses))) as pool:
        return list(pool.map(one, range(len(responses))))
