"""Records kept decoded by the identity of their bytes (`Decoded`): what a replay from the
replay cache reads instead of decoding the same bytes again."""

from __future__ import annotations

import pytest

from goblin_idem.exceptions import RecordError
from goblin_idem.records._format import Decoded, Record, decode, encode
from goblin_idem.sealing import Sealer

KEY = b"k" * 32
RECORD = Record(201, [(b"content-type", b"application/json")], b'{"id":1}', b"f" * 16)


def test_the_same_bytes_object_is_decoded_once() -> None:
    decoded = Decoded(1 << 20, None, False)
    data = encode(RECORD)
    first = decoded(data, b"r")
    assert first == decode(data) == RECORD
    assert decoded(data, b"r") is first
    copy = bytes(bytearray(data))  # equal bytes, another object: decoded afresh
    again = decoded(copy, b"r")
    assert again == first and again is not first


def test_a_sealed_record_is_kept_for_its_own_key_name_only() -> None:
    sealer = Sealer([KEY])
    decoded = Decoded(1 << 20, sealer, True)
    data = encode(RECORD, sealer=sealer, name=b"idem:{a}:r")
    assert decoded(data, b"idem:{a}:r") == RECORD
    with pytest.raises(RecordError):  # sealed for another name: opened, and refused, again
        decoded(data, b"idem:{b}:r")


def test_require_sealed_refuses_a_record_in_the_clear_every_time() -> None:
    decoded = Decoded(1 << 20, Sealer([KEY]), True)
    data = encode(RECORD)
    for _ in range(2):
        with pytest.raises(RecordError):
            decoded(data, b"r")
    assert not decoded.entries


def test_the_budget_bounds_what_is_kept_oldest_out_first() -> None:
    decoded = Decoded(4_000, None, False)
    big = encode(Record(200, [], b"x" * 1_100, b"f" * 16))  # over a quarter: never kept
    decoded(big, b"r")
    assert not decoded.entries
    kept = [encode(Record(200, [], b"%d" % i + b"y" * 700, b"f" * 16)) for i in range(6)]
    for data in kept:
        decoded(data, b"r")
        assert decoded.size <= decoded.budget
    assert [entry[0] for entry in decoded.entries.values()] == kept[-5:]
    assert decoded.size == sum(len(d) for d in kept[-5:])
