"""goblin-idem for Django: ``"goblin_idem.django.IdempotencyMiddleware"`` in MIDDLEWARE,
configured by ``settings.GOBLIN_IDEM``; ``@idempotent(...)`` on views."""

from ..middleware import idempotent
from ._middleware import IdempotencyMiddleware

__all__ = ["IdempotencyMiddleware", "idempotent"]
