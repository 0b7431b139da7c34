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
ALL = (CLAIM, CAEXPIRE, CAS, CAD)
