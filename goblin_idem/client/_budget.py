"""The retry budget's state: one token bucket per transport, safe across threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ._policy import RetryBudget

__all__ = ["TokenBucket"]


class TokenBucket:
    """The tokens a transport's calls draw on to retry (see `RetryBudget`).

    Refills are computed when the bucket is used, from the time since the last use. A lock
    makes `take` and `deposit` atomic across the threads of a sync client; they never
    await, so on an event loop they are atomic by construction and the lock is never
    contended there.
    """

    def __init__(self, budget: RetryBudget, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self._clock = clock
        self._tokens = budget.capacity
        self._at = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._at)
        self._at = now
        self._tokens = min(self.budget.capacity, self._tokens + elapsed * self.budget.per_second)

    @property
    def tokens(self) -> float:
        with self._lock:
            self._refill()
            return self._tokens

    def take(self) -> bool:
        """One retry's token, or False when the bucket is empty (then do not retry)."""
        with self._lock:
            self._refill()
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True

    def deposit(self) -> None:
        """A call ended in an answer: credit `per_success`."""
        with self._lock:
            self._refill()
            self._tokens = min(self.budget.capacity, self._tokens + self.budget.per_success)
