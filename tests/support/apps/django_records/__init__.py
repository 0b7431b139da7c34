"""A Django project whose views write through the ORM, under ``RECORDS: "django"``, for
tests/django/test_records.py, the fault run and the benchmark; configured by environment:

- ``DJANGO_DB``: ``postgresql://user@host:port/name`` or ``sqlite:///path``; ``OTHER_ALIAS=1``
  adds the alias ``other`` naming the same database; ``ATOMIC_REQUESTS=1``; ``PSYCOPG=2``
  (PostgreSQL through psycopg2, which Django uses when psycopg cannot be imported);
- ``REDIS_URL`` (the store), ``LEASE_SECONDS``, ``RECORDS=0`` (no records: the control),
  ``RECORDS_APP=0`` (goblin_idem.django not installed), ``GOBLIN_SETTINGS`` (JSON merged
  into GOBLIN_IDEM);
- ``HOOK_LOG``: a file the views' on_commit callbacks append to; ``KILL_AFTER_COMMIT_FILE``:
  the first commit after that file appears SIGKILLs its worker (the file is removed).

``POST /payments`` takes a JSON body ``{"ref", "amount", "mode"}``; see `views.pay`.
"""
