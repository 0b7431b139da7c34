"""goblin-idem for Django: ``"goblin_idem.django.IdempotencyMiddleware"`` in MIDDLEWARE,
configured by ``settings.GOBLIN_IDEM``; ``@idempotent(...)`` on views; `DjangoRecords` for a
gRPC server of the project (``goblin_idem.grpc.IdempotencyInterceptor(records=...)``)."""

from ..middleware import idempotent
from ._middleware import IdempotencyMiddleware
from ._records import DjangoRecords

__all__ = ["DjangoRecords", "IdempotencyMiddleware", "idempotent"]
