"""The records' table for ``RECORDS: "django"``: the shape of goblin_idem.sql's, one row per key.

The result key's name as the store has it (bytes, the primary key, which stops a second run
of the key at its commit), the key hash that logs show, the request fingerprint, the record
bytes the store gets (sealed when encryption is on), and when it was committed and expires.
The same table name as SqlRecords' default, so a Django service and a SQLAlchemy one on one
database share their records.
"""

from __future__ import annotations

from django.db import models  # type: ignore[import-untyped]

__all__ = ["TABLE", "Record"]

TABLE = "goblin_idem_records"


class Record(models.Model):  # type: ignore[misc]
    key = models.BinaryField(primary_key=True, max_length=255)
    key_hash = models.CharField(max_length=64)
    fingerprint = models.BinaryField(max_length=16)
    record = models.BinaryField()
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        app_label = "goblin_idem"
        db_table = TABLE
