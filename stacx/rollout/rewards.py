"""Reward functions: built-in verifiers, custom ones by import path, batched and contained.

A reward function takes one sample and returns a float:

    def my_reward(response: str, label, metadata: dict) -> float

or, marked with `@batched_reward`, lists of each argument and returns a list of floats.
`compute_rewards` runs them concurrently; an exception in a reward function marks that sample
(`RewardResult.error`, reward = `failure_reward`) and is logged, it never crashes the run. A call
that does not return within its timeout (`@reward_timeout(seconds)`, default
DEFAULT_REWARD_TIMEOUT_S) stops the run with `RewardTimeoutError` naming the function and sample.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import traceback
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Optional, Sequence

from stacx.plugins.discovery import import_builtin_and_custom_modules, is_file_path, resolve_callable
from stacx.plugins.registry import Registry

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, Any, dict], float]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function", ships_user_modules=False)  # rewards run in the driver
"""Name -> reward function (a `stacx.plugins.registry.Registry`: a name registered twice is refused)."""


def register_reward(name: str, *, needs_label: bool = False):
    """Decorator: register a reward function under `name` (duplicates are rejected).

    needs_label: the function compares the response with the row's label, so a dataset row without
    one is refused before the run starts (custom functions declare it with `fn.needs_label = True`).
    """
    register = REWARD_FUNCTIONS.register(name)

    def decorator(fn):
        register(fn)
        fn.needs_label = bool(needs_label)
        return fn

    return decorator


def batched_reward(fn):
    """Mark `fn(responses, labels, metadatas) -> list[float]` as taking whole batches."""
    fn.batched = True
    return fn


def resolve_reward_fn(spec: str) -> RewardFn:
    """A registered name ('exact_match', or one a `--custom-module` file or `stacx/custom/` registers
    with `@register_reward`), an import path 'package.module:function', or a file and a function
    'path/to/my_reward.py:function' (loaded as `--custom-module` loads files). Rewards are computed
    where rollouts are collected (the driver), so a reward file is not shipped to the role workers."""
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    import_builtin_and_custom_modules()  # stacx/custom/ files may register rewards
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        hint = REWARD_FUNCTIONS.close_match_hint(spec)
        file_hint = (f"give the function too ({spec}:my_reward), " if is_file_path(spec) else "")
        raise ValueError(f"reward_fn {spec!r} is neither a built-in or registered reward nor 'module:function' or "
                         f"'path/to/file.py:function'; {hint}{file_hint}registered rewards: "
                         f"{', '.join(sorted(REWARD_FUNCTIONS))} (register yours with @register_reward)")
    return resolve_callable(spec, flag="--reward-fn")


def reward_needs_label(reward_fn) -> bool:
    """True when the reward function declares that it reads the label (`needs_label`)."""
    return bool(getattr(reward_fn, "needs_label", False))


# ---- built-in verifiers ------------------------------------------------------------------------

@register_reward("exact_match", needs_label=True)
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


@register_reward("math", needs_label=True)
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


class RewardTimeoutError(RuntimeError):
    """A reward function did not return within its timeout; the message names the function and the sample."""


DEFAULT_REWARD_TIMEOUT_S = 120.0
"""Per-call timeout of a reward function unless it declares its own with `@reward_timeout(seconds)`."""


def reward_timeout(seconds: float):
    """Decorator: this reward function may take up to `seconds` per call (per batch if batched)."""
    if not seconds > 0:
        raise ValueError(f"reward_timeout: seconds must be > 0, got {seconds}")

    def decorator(fn):
        fn.timeout_s = float(seconds)
        return fn

    return decorator


def reward_fn_name(reward_fn) -> str:
    """'module:function' of a reward function (what --reward-fn would name it)."""
    module = getattr(reward_fn, "__module__", None) or "?"
    return f"{module}:{getattr(reward_fn, '__qualname__', None) or type(reward_fn).__name__}"


def _start_call(fn, args) -> tuple[threading.Event, dict]:
    """Run fn(*args) in a daemon thread: a call that never returns cannot keep the process alive
    (a ThreadPoolExecutor's threads are joined at exit, so a hanging reward would block Ctrl-C)."""
    done, box = threading.Event(), {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box["error"] = err
        finally:
            done.set()

    threading.Thread(target=target, name="stacx-reward", daemon=True).start()
    return done, box


def _timed_out(reward_fn, timeout_s: float, what: str, response: str) -> RewardTimeoutError:
    preview = response[:80] + ("..." if len(response) > 80 else "")
    return RewardTimeoutError(
        f"reward function {reward_fn_name(reward_fn)} did not return within {timeout_s:g} s on {what} "
        f"(response {preview!r}); fix the function, or give it more time with @reward_timeout(seconds) "
        f"from stacx.rollout.rewards")


def compute_rewards(
    reward_fn: RewardFn,
    responses: Sequence[str],
    labels: Sequence[Any],
    metadatas: Optional[Sequence[dict]] = None,
    *,
    max_workers: int = 8,
    failure_reward: float = 0.0,
    timeout_s: Optional[float] = None,
) -> list[RewardResult]:
    """Rewards for every sample; failures are contained per sample (or per batch if batched).

    Each call runs under a timeout (`timeout_s`, else the function's `@reward_timeout`, else
    DEFAULT_REWARD_TIMEOUT_S): a call that does not return raises `RewardTimeoutError` naming the
    function and the sample, since a reward that hangs is not a per-sample accident.
    """
    metadatas = list(metadatas) if metadatas is not None else [{} for _ in responses]
    if not len(responses) == len(labels) == len(metadatas):
        raise ValueError(f"compute_rewards: {len(responses)} responses, {len(labels)} labels, {len(metadatas)} metadatas")
    if timeout_s is None:
        timeout_s = float(getattr(reward_fn, "timeout_s", DEFAULT_REWARD_TIMEOUT_S))

    def describe(err: BaseException) -> str:
        where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
        return f"{type(err).__name__}: {err}" + (f" (at {where.filename}:{where.lineno})" if where else "")

    if getattr(reward_fn, "batched", False):
        done, box = _start_call(reward_fn, (list(responses), list(labels), metadatas))
        if not done.wait(timeout_s):
            raise _timed_out(reward_fn, timeout_s, f"a batch of {len(responses)} samples",
                             responses[0] if responses else "")
        try:
            if "error" in box:
                raise box["error"]
            values = list(box["value"])
            if len(values) != len(responses):
                raise ValueError(f"batched reward returned {len(values)} values for {len(responses)} samples")
            return [RewardResult(float(v)) for v in values]
        except Exception as err:
            logger.error("batched reward function failed for %d samples: %s", len(responses), describe(err))
            return [RewardResult(failure_reward, describe(err)) for _ in responses]

    results: list[Optional[RewardResult]] = [None] * len(responses)
    window = max(1, int(max_workers))
    for first in range(0, len(responses), window):  # at most `window` calls at once
        indices = range(first, min(first + window, len(responses)))
        calls = {i: _start_call(reward_fn, (responses[i], labels[i], metadatas[i])) for i in indices}
        deadline = time.monotonic() + timeout_s
        for i, (done, box) in calls.items():
            if not done.wait(max(0.0, deadline - time.monotonic())):
                raise _timed_out(reward_fn, timeout_s, f"sample {i}", responses[i])
            try:
                if "error" in box:
                    raise box["error"]
                results[i] = RewardResult(float(box["value"]))
            except Exception as err:
                logger.error("reward function failed on sample %d: %s", i, describe(err))
                results[i] = RewardResult(failure_reward, describe(err))
    return results
