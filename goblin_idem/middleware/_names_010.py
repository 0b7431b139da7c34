"""Keys used under 0.1.0's store names (``previous_key_names=True``; CHANGELOG.md: Upgrading
from 0.1.0): read once a key is claimed under this release's names, on first runs only."""

from __future__ import annotations

import logging

from .._closing import free_claim
from .._keys import KeyNames, previous_names
from .._log import describe
from ..store import CLAIMED, ClaimReply, Store

__all__ = ["previous_reply"]

logger = logging.getLogger("goblin_idem.middleware")


async def previous_reply(
    store: Store, namespace: bytes, names: KeyNames, token: bytes
) -> ClaimReply:
    """What the claim step would have replied under 0.1.0's names, for a key just claimed
    (with `token`) under this release's.

    A result stored there is the reply, and is copied under the new names for its
    remaining TTL, so that later duplicates are answered by the claim step alone; a claim
    held there (a 0.1.0 process running the work) is None (in flight); CLAIMED if the old
    names hold neither. Unless CLAIMED, the new claim is freed, as it is before a store
    error is raised. Up to three reads. Not atomic with the claim: a 0.1.0 process that
    claims the old names after these reads runs the work a second time."""
    old = previous_names(namespace, names.hash)
    try:
        data = await store.get(old.result)
        ttl = await store.pttl(old.result) if data is not None else -2
        held = data is None and await store.get(old.claim) is not None
    except Exception:
        await free_claim(store, names, token)
        raise
    if data is None and not held:
        return CLAIMED
    if data is None:
        await free_claim(store, names, token)
        return None
    try:
        if ttl <= 0 or await store.publish(names.result, data, ttl, names.claim, token) != 1:
            await free_claim(store, names, token)
    except Exception as exc:  # the answer stands; a later duplicate reads the old names
        logger.warning(
            "key %s: could not copy the result stored under 0.1.0's names: %s",
            names.hash,
            describe(exc),
        )
        await free_claim(store, names, token)
    return data
