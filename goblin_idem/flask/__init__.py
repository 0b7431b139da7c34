"""goblin-idem for Flask: ``Idempotency(app, store=...)`` (or ``init_app``).

The app's WSGI callable is wrapped in goblin_idem.wsgi.IdempotencyMiddleware, with the
ASGI middleware's options, and ``@idempotent(...)`` on a view (a function, a View or
MethodView class, or the class's method for the request's method) is found with Flask's
own URL map, as Flask routes the request.
"""

from ..middleware import idempotent
from ._extension import Idempotency

__all__ = ["Idempotency", "idempotent"]
