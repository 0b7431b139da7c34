"""Webhook receivers: each delivery verified by its provider's signature before the claim,
keyed by what that signature covers (the signed delivery id, or the signed body's digest),
run once.

``@webhook(Stripe(secrets=[...]))`` under a route decorator, or the middleware's
``webhooks={"/hooks/github": GitHub(secrets=[...])}`` for a path; docs/webhooks.md.
"""

from .._provider import Delivery, Provider
from ..exceptions import WebhookRefusedError
from ._github import GitHub
from ._mark import webhook
from ._shopify import Shopify
from ._standard import StandardWebhooks
from ._stripe import Stripe

__all__ = [
    "Delivery",
    "GitHub",
    "Provider",
    "Shopify",
    "StandardWebhooks",
    "Stripe",
    "WebhookRefusedError",
    "webhook",
]
