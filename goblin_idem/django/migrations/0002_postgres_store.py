"""PostgresStore's table, when ``GOBLIN_IDEM["STORE"]`` is ``"postgres"``: made in the
``default`` database, the one that store uses (the same DDL as `PostgresStore.create_table`
and ``python -m goblin_idem postgres-ddl``)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.conf import settings  # type: ignore[import-untyped]
from django.db import migrations  # type: ignore[import-untyped]

from goblin_idem.store._postgres_sql import DEFAULT_TABLE, ddl


def _store_here(schema_editor: Any) -> bool:
    setting = getattr(settings, "GOBLIN_IDEM", {})
    return (
        isinstance(setting, dict)
        and setting.get("STORE") == "postgres"
        and schema_editor.connection.alias == "default"
        and schema_editor.connection.vendor == "postgresql"
    )


def create(apps: Any, schema_editor: Any) -> None:
    if _store_here(schema_editor):
        for statement in ddl().split(";\n"):  # one statement per execute, as drivers want
            if statement.strip():
                schema_editor.execute(statement)


def drop(apps: Any, schema_editor: Any) -> None:
    if _store_here(schema_editor):
        schema_editor.execute(f"DROP TABLE IF EXISTS {DEFAULT_TABLE}")


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies: ClassVar[list[Any]] = [("goblin_idem", "0001_initial")]

    operations: ClassVar[list[Any]] = [migrations.RunPython(create, drop)]
