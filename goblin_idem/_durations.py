"""One unit for durations: every duration of the public API is a number of seconds (an
int or a float); the store's own units (GOBLIN.CLAIM's whole seconds, PX and CAEXPIRE's
milliseconds) are derived from it where a command is built. Names that were in
milliseconds still work for one release, with a DeprecationWarning."""

from __future__ import annotations

import math
import warnings

__all__ = ["kind", "renamed_ms", "seconds"]


def kind(value: object) -> str:
    """``an int``, ``a str``: the type of a refused value, for the message."""
    name = type(value).__name__
    return ("an " if name[:1] in "aeiou" else "a ") + name


def seconds(name: str, value: object, *, minimum: float) -> float:
    """A duration: a number of seconds (int or float, not a bool), finite, of at least
    `minimum`. Every duration of the public API is in seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a number of seconds (int or float) >= {minimum:g}, not {kind(value)}"
        )
    if not minimum <= value < math.inf:
        raise ValueError(f"{name} must be >= {minimum:g} (seconds, finite), got {value}")
    return float(value)


def renamed_ms(old: str, old_value: object, new: str, new_value: float, stacklevel: int) -> float:
    """A duration whose name moved from milliseconds to seconds: `new_value`, unless only
    the old name was given (not None), which still works for one release with a
    DeprecationWarning that names the new one."""
    if old_value is None:
        return new_value
    warnings.warn(
        f"{old} is deprecated (every duration is in seconds now): pass {new}= instead; "
        f"{old} will be removed in 0.3.0",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    if isinstance(old_value, bool) or not isinstance(old_value, (int, float)):
        raise TypeError(f"{old} must be a number of milliseconds, not {kind(old_value)}")
    return old_value / 1000
