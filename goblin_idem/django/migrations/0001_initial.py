"""The records' table (goblin_idem.django.models.Record)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations, models  # type: ignore[import-untyped]


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True

    dependencies: ClassVar[list[Any]] = []

    operations: ClassVar[list[Any]] = [
        migrations.CreateModel(
            name="Record",
            fields=[
                ("key", models.BinaryField(max_length=255, primary_key=True, serialize=False)),
                ("key_hash", models.CharField(max_length=64)),
                ("fingerprint", models.BinaryField(max_length=16)),
                ("record", models.BinaryField()),
                ("created_at", models.DateTimeField()),
                ("expires_at", models.DateTimeField(db_index=True)),
            ],
            options={"db_table": "goblin_idem_records"},
        ),
    ]
