"""`forget`: an operator lets a key run again, by removing what answers it: the SQL record
(the truth), then the stored result (with the redirects its runs answered) and the claim.

Every way of forgetting a key (the function, ``python -m goblin_idem forget``) is this one
function, so whatever else comes to hold a key's answer is removed here too.

The order keeps a duplicate arriving meanwhile from bringing the answer back: the record
first (a won claim with no result looks the database up, and would publish the record back
to the store), then the result, then the claim, deleted only if it still holds the token
read at the start (CAD), so a run that claimed the key since is left alone. A key in flight
(a claim, and no result in the store or the database) is refused: deleting its claim would
let a second run start while the first one still runs.
"""

from __future__ import annotations

from . import _options as options
from ._keys import KeyNames, hop_key
from ._recording import Records
from ._threaded import outside_requests
from .exceptions import InFlightError
from .inspection import names_given
from .store import KeyT, Store

__all__ = ["forget"]


async def forget(
    store: Store,
    key: KeyT | None = None,
    *,
    scope: KeyT = b"",
    namespace: KeyT = b"idem",
    names: KeyNames | None = None,
    records: Records | None = None,
) -> bool:
    """Remove `key`'s claim, stored result and (with `records`) SQL record, so that the next
    request with it runs the handler again; True if anything was removed.

    The key is named as the middleware names it: in `scope` (by default the request's
    Authorization header value, empty for anonymous callers) and `namespace`; a `once`
    function's key in namespace ``"once"`` with the function's name as the scope. Give
    `names` instead (`goblin_idem.inspection.names_for_hash`) for a key hash a log line
    shows. Raises InFlightError, removing nothing, while a run holds the key.
    """
    store = options.store(store)
    records = options.records(outside_requests(records))
    if records is not None and not callable(getattr(records, "forget", None)):
        raise TypeError("records must be SqlRecords(engine) from goblin_idem.sql, with forget()")
    names = names_given(key, scope, namespace, names)
    token = await store.get(names.claim)
    completed = await store.get(names.result) is not None
    if token is not None and not completed and records is not None:
        completed = await records.lookup(names.result) is not None
    if token is not None and not completed:
        ms = await store.pttl(names.claim)
        raise InFlightError(
            f"key {names.hash} is in flight (a run holds its claim, and nothing is stored "
            "yet): forgetting it would let a second run start beside it. Wait for the run "
            "to end, or for its lease to run out",
            key_hash=names.hash,
            retry_after=max(ms, 0) / 1000,
        )
    removed = records is not None and await records.forget(names.result)
    # RedisStore.delete also drops this process's replay cache entry at once; other
    # processes drop theirs on the server's invalidation.
    removed = bool(await store.delete(names.result, hop_key(names))) or removed
    if token is not None:
        removed = bool(await store.cad(names.claim, token)) or removed
    return removed
