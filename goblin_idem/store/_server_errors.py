"""What a Redis-protocol server's error replies read as: one error-text policy.

Both modes of RedisStore raise the texts the native commands reply (a Lua script's error
carries its own wording and the script's SHA), and an ACL refusal becomes a
`StorePermissionError` that says which rule to add.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

from redis.exceptions import NoPermissionError, ResponseError

from ..exceptions import StorePermissionError

__all__ = [
    "NOT_INTEGER",
    "SCRIPT_CALLS",
    "VALUE_TOO_LARGE",
    "WRONGTYPE",
    "acl_rule",
    "invalid_expire",
    "normalize",
    "permission_error",
    "renewal_reply",
    "unwrap",
]

# The spec's reply texts (../spec), as every store gives them; redis-py strips the leading
# ``ERR `` of an error reply, as it does for any server.
WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
NOT_INTEGER = "value is not an integer or out of range"
VALUE_TOO_LARGE = (
    "new cannot fit the configured value encoding (larger values belong in a blob store)"
)


def invalid_expire(command: str) -> str:
    return f"invalid expire time in '{command}' command"


# How servers word an ACL refusal: Redis 7 and Valkey name the command ("... no permissions to
# run the 'set' command", inside a Lua script too on Valkey); inside a script Redis 7.0 does
# not; a refused key is "no permissions to access a key" / "... one of the keys ...".
_DENIED_COMMAND: Final = re.compile(r"no permissions to run the '([^']+)' command")
_DENIED_IN_SCRIPT: Final = "can't run this command or subcommand"
_DENIED_KEY: Final = re.compile(r"no permissions to access (a|one of the) key", re.IGNORECASE)
#: What goblin-idem's Lua scripts call, besides the commands the store sends itself.
SCRIPT_CALLS: Final = ("set", "get", "pexpire", "del")


def acl_rule(commands: Sequence[str]) -> str:
    """The ACL SETUSER arguments that allow `commands` ("+set +config|get")."""
    return " ".join(f"+{c}" for c in commands)


def permission_error(exc: Exception, user: str = "<user>") -> StorePermissionError | None:
    """`exc` as a StorePermissionError that names the fix, if an ACL refused something."""
    if isinstance(exc, StorePermissionError):
        return exc
    text = str(exc)
    named = _DENIED_COMMAND.search(text)
    if named is not None or _DENIED_IN_SCRIPT in text:
        denied = (named.group(1).lower(),) if named is not None else SCRIPT_CALLS
        what = f"'{denied[0]}'" if named is not None else "a command its Lua scripts call"
        return StorePermissionError(
            f"the store's ACL user may not run {what}, which goblin-idem needs ({text}); "
            f"allow it: ACL SETUSER {user} {acl_rule(denied)} (RedisStore.detect() names "
            "every command it sends that the server refuses)",
            denied=denied,
        )
    if isinstance(exc, NoPermissionError) or _DENIED_KEY.search(text):
        return StorePermissionError(
            f"the store's ACL user may not use a key goblin-idem needs ({text}); allow the "
            f"middleware's namespace, e.g. ACL SETUSER {user} ~idem:*",
            keys=True,
        )
    return None


def normalize(exc: ResponseError, user: str = "<user>") -> ResponseError:
    """Give a script-mode error the text the native command replies with, and an ACL refusal
    the form that says what to allow.

    Validation makes this a safety net: only WRONGTYPE can normally come out of a script,
    and Redis 7 appends ``script: <sha>, on @user_script:N.`` to it.
    """
    denied = permission_error(exc, user)
    if denied is not None:
        return denied
    if type(exc) is not ResponseError:
        return exc
    text = str(exc)
    if text.startswith("WRONGTYPE"):
        return ResponseError(WRONGTYPE)
    if " script: " in text:
        text = text.split(" script: ", 1)[0]
        text = text.replace("in 'set' command", "in 'goblin.claim' command")
        text = text.replace("in 'pexpire' command", "in 'goblin.caexpire' command")
        return ResponseError(text)
    return exc


def unwrap(reply: Any, user: str = "<user>") -> Any:
    """A pipelined reply, or the error in its place raised (in the form `normalize` gives)."""
    if isinstance(reply, ResponseError):
        raise normalize(reply, user)
    if isinstance(reply, Exception):
        raise reply
    return reply


def renewal_reply(reply: Any, user: str) -> int | Exception:
    """One CAEXPIRE's reply of a batch: the count, or its error returned in place."""
    if isinstance(reply, ResponseError):
        return normalize(reply, user)
    return reply if isinstance(reply, Exception) else int(reply)
