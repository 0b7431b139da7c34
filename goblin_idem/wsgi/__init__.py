"""goblin-idem for WSGI (PEP 3333) apps: the ASGI middleware's guarantees and options.

``app = IdempotencyMiddleware(app, store=RedisStore.from_url(url))``; Flask apps are better
served by goblin_idem.flask (which also honours ``@idempotent`` on views), Django by
goblin_idem.django.
"""

from ._middleware import IdempotencyMiddleware

__all__ = ["IdempotencyMiddleware"]
