"""What a call may retry and how long it waits: plain values and pure functions, no I/O.

The sync and async transports share all of it; only sending and sleeping differ.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from datetime import timezone
from email.utils import parsedate_to_datetime

__all__ = [
    "DEFAULT_RETRY_STATUSES",
    "RetryBudget",
    "RetryPolicy",
    "backoff_delay",
    "parse_retry_after",
]

# 409: a duplicate of a request that is still running (the server says when to come back);
# 429: throttled; 500: the handler failed, and the server released the key, so the retry
# runs it again (a goblin-idem server stores no 5xx by default, and its handlers must leave
# nothing behind when they fail); 502, 503, 504: a proxy, or a store outage, in the way.
DEFAULT_RETRY_STATUSES = frozenset({409, 429, 500, 502, 503, 504})

_SECONDS = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True, slots=True)
class RetryBudget:
    """How many retries one transport may make, as a token bucket shared by all its calls
    (its rules and each field: docs/client.md). Under a sustained outage a transport adds
    at most `capacity` retries, then `per_second`, on top of the calls themselves; while
    most calls succeed, retries stay near `per_success` of them."""

    capacity: float = 20.0
    per_second: float = 1.0
    per_success: float = 0.1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.capacity) and self.capacity >= 1):
            raise ValueError(f"RetryBudget capacity must be at least 1, not {self.capacity!r}")
        for name in ("per_second", "per_success"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"RetryBudget {name} must be 0 or more, not {value!r}")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When a call is retried, and how long it waits (each field, and the backoff's full
    jitter: docs/client.md)."""

    max_attempts: int = 5
    base_delay: float = 0.5
    max_delay: float = 10.0
    deadline: float | None = 30.0
    retry_statuses: Collection[int] = DEFAULT_RETRY_STATUSES
    budget: RetryBudget | None = field(default_factory=RetryBudget)

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise TypeError(f"max_attempts must be an int, not {self.max_attempts!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {self.max_attempts}")
        for name in ("base_delay", "max_delay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be 0 or more seconds, not {value!r}")
        if self.deadline is not None and not (math.isfinite(self.deadline) and self.deadline > 0):
            raise ValueError(f"deadline must be None or more than 0 seconds, not {self.deadline!r}")
        statuses = _statuses(self.retry_statuses)
        object.__setattr__(self, "retry_statuses", statuses)


def _statuses(values: Iterable[int]) -> frozenset[int]:
    statuses = frozenset(values)
    bad = sorted(str(s) for s in statuses if not isinstance(s, int) or not 100 <= s <= 599)
    if bad:
        raise ValueError(f"retry_statuses must be HTTP status codes, not {', '.join(bad)}")
    return statuses


def backoff_delay(retry: int, base_delay: float, max_delay: float) -> float:
    """The wait before retry number `retry` (1 for the first): full jitter, capped."""
    ceiling = min(max_delay, base_delay * 2.0 ** min(retry - 1, 64))
    return random.uniform(0.0, ceiling)


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delay-seconds or an HTTP-date (RFC 9110
    10.2.3), read against `now` (a Unix time). A date in the past is 0; anything else
    unreadable is None, and the caller falls back to its backoff."""
    if value is None:
        return None
    value = value.strip()
    if _SECONDS.fullmatch(value):
        seconds = float(value)
        return seconds if math.isfinite(seconds) else None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is always GMT
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - now)
