"""The four GOBLIN commands as Lua, for servers that lack them natively.

The bodies are the spec's, verbatim: each runs atomically on the server (a script is never
interleaved with other commands), which is the whole guarantee the native commands give.
Arguments are validated in Python before a script is sent, so the script's own error
texts (``... script: ...``) are never what a caller sees.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CLAIM_LUA = """\
if redis.call("set", KEYS[1], ARGV[1], "NX", "EX", ARGV[2]) then
  return "CLAIMED"
end
return redis.call("get", KEYS[2])
"""

CAEXPIRE_LUA = """\
if redis.call("get", KEYS[1]) == ARGV[1] then
  return redis.call("pexpire", KEYS[1], ARGV[2])
end
return 0
"""

CAS_LUA = """\
if redis.call("get", KEYS[1]) == ARGV[1] then
  return redis.call("set", KEYS[1], ARGV[2], "KEEPTTL")
end
return 0
"""

CAD_LUA = """\
if redis.call("get", KEYS[1]) == ARGV[1] then
  return redis.call("del", KEYS[1])
end
return 0
"""

# Not a GOBLIN command: `Store.forget`, an operator's step, rare and never on a request's
# path, runs as this script on every server, the module's included (its ACL then needs
# +evalsha +script|load): one body serves servers whose module predates it, with nothing to
# fall back on. A claim is deleted with the rest only if no run holds it: absent, holding
# ARGV[1] (the token the caller saw completed; no ARGV matches nothing), or guarding a
# stored result. KEYS[1] is the claim, KEYS[2] the result; the rest go with them.
FORGET_LUA = """\
local held = redis.call("get", KEYS[1])
if held and held ~= ARGV[1] and redis.call("exists", KEYS[2]) == 0 then
  return -1
end
return redis.call("del", unpack(KEYS))
"""


@dataclass(frozen=True)
class Script:
    """A Lua body with the SHA1 that EVALSHA names it by (computed here, not asked of a server)."""

    command: str
    body: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.body.encode()).hexdigest())

    def call(self, native: bool, keys: Sequence[bytes], args: Sequence[Any]) -> tuple[Any, ...]:
        """The command that runs it: the native GOBLIN command, or EVALSHA of the body."""
        if native:
            return (self.command, *keys, *args)
        return ("EVALSHA", self.sha, len(keys), *keys, *args)


CLAIM = Script("goblin.claim", CLAIM_LUA)
CAEXPIRE = Script("goblin.caexpire", CAEXPIRE_LUA)
CAS = Script("goblin.cas", CAS_LUA)
CAD = Script("goblin.cad", CAD_LUA)
FORGET = Script("goblin.forget", FORGET_LUA)  # never native: see FORGET_LUA
GOBLIN = (CLAIM, CAEXPIRE, CAS, CAD)
ALL = (*GOBLIN, FORGET)  # what SCRIPT LOAD loads
