"""A Django project for the sync integration's tests: served by gunicorn (WSGI) and uvicorn
(ASGI), configured by environment: REDIS_URL (the store; the embedded MemoryStore if unset),
LEASE_SECONDS, GOBLIN_SETTINGS (JSON merged into GOBLIN_IDEM)."""
