"""The views' effects: payments; and tickets, whose code is unique, checked at COMMIT on
PostgreSQL (a deferred constraint: a commit that fails after every statement passed)."""

from __future__ import annotations

import os

from django.db import models


class Payment(models.Model):
    ref = models.CharField(max_length=64, db_index=True)
    amount = models.IntegerField()

    class Meta:
        db_table = "payments"  # as tests/support/apps/sql_app's, for the fault run's counts


class Ticket(models.Model):
    code = models.CharField(max_length=64)

    class Meta:
        constraints = (
            [
                models.UniqueConstraint(
                    fields=["code"],
                    name="ticket_code_at_commit",
                    deferrable=models.Deferrable.DEFERRED,
                )
            ]
            if os.environ.get("DJANGO_DB", "").startswith("postgresql")
            else []
        )
