"""`once`: exactly-once runs of any coroutine function, on the middleware's claim step.

- `_once`: the decorator and its one call (claim, run, publish or release).
- `_codecs`: how a return value is stored (`Codec`, JSON, dataclasses, pydantic models).
"""

from ._codecs import Codec, DataclassCodec, JsonCodec, PydanticCodec
from ._once import once

__all__ = ["Codec", "DataclassCodec", "JsonCodec", "PydanticCodec", "once"]
