"""The Django app that holds the records' model and migration (``RECORDS: "django"``)."""

from __future__ import annotations

from django.apps import AppConfig  # type: ignore[import-untyped]

__all__ = ["GoblinIdemConfig"]


class GoblinIdemConfig(AppConfig):  # type: ignore[misc]
    """``"goblin_idem.django"`` in INSTALLED_APPS; its label, ``goblin_idem``, names its
    migrations (``python manage.py migrate goblin_idem``)."""

    name = "goblin_idem.django"
    label = "goblin_idem"
    verbose_name = "goblin-idem records"
