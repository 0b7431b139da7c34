"""Exactly-once gRPC calls: AIP-155's ``request_id`` honoured by server interceptors, and
sent (or derived inside a claimed run) by client interceptors.

```python
server = grpc.aio.server(interceptors=[AsyncIdempotencyInterceptor(store)])
channel = grpc.aio.insecure_channel(target, interceptors=[AsyncIdempotentClientInterceptor()])
```

It needs grpcio and protobuf (``pip install 'goblin-idem[grpc]'``); ``import goblin_idem``
does not. See docs/grpc.md.
"""

try:
    import google.protobuf  # noqa: F401
    import grpc  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "goblin_idem.grpc needs grpcio and protobuf: pip install 'goblin-idem[grpc]'"
    ) from exc

from ._client import (
    LABEL_METADATA,
    AsyncIdempotentClientInterceptor,
    IdempotentClientInterceptor,
    RetryPolicy,
)
from ._outcome import DEFINITIVE
from ._server import AsyncIdempotencyInterceptor, IdempotencyInterceptor

__all__ = [
    "DEFINITIVE",
    "LABEL_METADATA",
    "AsyncIdempotencyInterceptor",
    "AsyncIdempotentClientInterceptor",
    "IdempotencyInterceptor",
    "IdempotentClientInterceptor",
    "RetryPolicy",
]
