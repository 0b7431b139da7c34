"""The client half of exactly-once: httpx transports that key requests and retry them safely.

```python
import httpx
from goblin_idem.client import AsyncIdempotentTransport, RetryPolicy

client = httpx.AsyncClient(transport=AsyncIdempotentTransport(policy=RetryPolicy(max_attempts=5)))
r = await client.post(url, json=payment)  # a key is added and kept across retries
r.extensions["idempotency"]  # {"key": ..., "attempts": n, "replayed": bool}
```

It needs httpx (``pip install 'goblin-idem[client]'``); ``import goblin_idem`` does not.
"""

try:
    import httpx  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("goblin_idem.client needs httpx: pip install 'goblin-idem[client]'") from exc

from ._budget import TokenBucket
from ._call import NON_RETRYABLE_TYPES, RetryEvent
from ._policy import (
    DEFAULT_RETRY_STATUSES,
    RetryBudget,
    RetryPolicy,
    backoff_delay,
    parse_retry_after,
)
from ._transports import AsyncIdempotentTransport, IdempotentTransport

__all__ = [
    "DEFAULT_RETRY_STATUSES",
    "NON_RETRYABLE_TYPES",
    "AsyncIdempotentTransport",
    "IdempotentTransport",
    "RetryBudget",
    "RetryEvent",
    "RetryPolicy",
    "TokenBucket",
    "backoff_delay",
    "parse_retry_after",
]
