"""`forget`: an operator lets a key run again, by removing what answers it: the SQL record
(the truth), then the stored result (with the redirects its runs answered, and a broker
consumer's count of its failed deliveries) and the claim.

Every way of forgetting a key (the function, ``python -m goblin_idem forget``) is this one
function, so whatever else comes to hold a key's answer is removed here too.

The store's part is one atomic step (`Store.forget`): the result, the redirects and the
claim go together, and only while no run holds the claim. Read-then-delete would race the
key's first run: with no claim read, a run that claimed, ran and published before the
deletes lost its result and kept its claim, extended to the result's TTL, so every later
request was answered 409 for a day (16 of 400 keys in a race).

With SQL records the record goes first: a duplicate that wins the claim looks the database
up, and would publish a record still there back to the store. A claim with no stored result
is then a run in flight unless the record shows its run committed (the store lost the
result, or its publish failed); only then is that claim's token passed as the one the step
may delete. A run that commits between the record's removal and the store's step either
still holds its claim with nothing stored (refused: in flight, its record left with it), or
has published (both removed with the claim; its record, committed after, answers the next
request as if it had run after the forget): the store never holds a result the database
lacks. Not covered: a run that committed before the forget and publishes only after its
store step (the store then held its claim alone) writes its result back, since a publish
does not ask for the claim. A key in flight is refused with InFlightError: deleting its
claim would let a second run start while the first one still runs.
"""

from __future__ import annotations

from . import _options as options
from ._keys import KeyNames, failures_key, hop_key
from ._recording import Records
from ._threads._records import outside_requests
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
    request with it runs the handler again; True if anything was removed. Raises
    InFlightError, removing nothing, while a run holds the key. A `once` function's key is
    in namespace ``"once"``, with the function's name as the scope.
    """
    store = options.store(store)
    records = options.records(outside_requests(records))
    if records is not None and not callable(getattr(records, "forget", None)):
        raise TypeError("records must be SqlRecords(engine) from goblin_idem.sql, with forget()")
    names = names_given(key, scope, namespace, names)
    expected = None
    removed = False
    if records is not None:
        token = await store.get(names.claim)
        if token is not None and await store.get(names.result) is None:
            if await records.lookup(names.result) is None:
                raise await _in_flight(store, names)
            expected = token  # its run committed: the claim guards nothing running
        removed = await records.forget(names.result)
    # RedisStore also drops the key from every replay cache of this process, before and
    # after the step; other processes drop theirs on the server's invalidation.
    deleted = await store.forget(
        names.claim, names.result, hop_key(names), failures_key(names), expected=expected
    )
    if deleted < 0:
        raise await _in_flight(store, names)
    return deleted > 0 or removed


async def _in_flight(store: Store, names: KeyNames) -> InFlightError:
    ms = await store.pttl(names.claim)
    return InFlightError(
        f"key {names.hash} is in flight (a run holds its claim, and nothing is stored "
        "yet): forgetting it would let a second run start beside it. Wait for the run "
        "to end, or for its lease to run out",
        key_hash=names.hash,
        retry_after=max(ms, 0) / 1000,
    )
