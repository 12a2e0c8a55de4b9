"""One range check for settings: `require_in_range("--flag", value, at_least=..., below=...)`.

A frozen settings dataclass checks each number in `__post_init__` with one call instead of an `if` and a hand-written
message; the message always names the setting (its flag or field), the allowed range and the value given:

    require_in_range("--lora-dropout", self.dropout, at_least=0, below=1)
    # ValueError: --lora-dropout must be in [0, 1), got 1.5

Standard library only: the wire, the models, the rollout and the run config all use it.
"""

from __future__ import annotations

from typing import Optional


def require_in_range(name: str, value: float, *, at_least: Optional[float] = None, above: Optional[float] = None,
                     at_most: Optional[float] = None, below: Optional[float] = None,
                     error: type[ValueError] = ValueError, why: str = "") -> None:
    """Raise `error` naming `name`, the range and `value` unless `value` lies within the bounds given (a lower one:
    `at_least` or `above`; an upper one: `at_most` or `below`). `why`: words added after the range ("to attach
    adapters")."""
    if at_least is not None and above is not None or at_most is not None and below is not None:
        raise TypeError("require_in_range: give at most one lower bound (at_least, above) and one upper bound "
                        "(at_most, below)")
    low = at_least if at_least is not None else above
    high = at_most if at_most is not None else below
    if low is None and high is None:
        raise TypeError("require_in_range: give a bound")
    fits = ((at_least is None or value >= at_least) and (above is None or value > above)
            and (at_most is None or value <= at_most) and (below is None or value < below))
    if fits:
        return
    if high is None:
        allowed = f"{'>=' if at_least is not None else '>'} {low:g}"
    elif low is None:
        allowed = f"{'<=' if at_most is not None else '<'} {high:g}"
    else:
        allowed = (f"in {'[' if at_least is not None else '('}{low:g}, {high:g}{']' if at_most is not None else ')'}")
    raise error(f"{name} must be {allowed}{' ' + why if why else ''}, got {value!r}")


__all__ = ["require_in_range"]
