"""An example FastAPI app on goblin-idem: payments, webhooks, orders with If-Match, jobs.

``python -m example_app`` serves it; ``python -m example_app.demo`` walks through what the
middleware does for retries, duplicates, races and crashes.
"""

from .app import app_from_env, create_app

__all__ = ["app_from_env", "create_app"]
