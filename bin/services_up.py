"""Which of PostgreSQL (DATABASE_URL) and Redis (REDIS_URL) answer.

Prints ``postgres=up|down redis=up|down`` and exits 0 when both answer;
the database is created if the server is up but the database is missing.
"""

import os
import sys

import psycopg
import redis
from psycopg import sql


def postgres_up(database_url: str) -> bool:
    if not database_url.startswith(("postgres://", "postgresql://")):
        return False
    try:
        base, name = database_url.rsplit("/", 1)
        name = name.split("?", 1)[0]
        with psycopg.connect(f"{base}/postgres", connect_timeout=3, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except Exception as exc:  # any failure means: not usable
        print(f"  (PostgreSQL: {type(exc).__name__}: {exc})", file=sys.stderr)
        return False
    return True


def redis_up(redis_url: str) -> bool:
    if not redis_url:
        return False
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=2).ping()
    except Exception as exc:  # any failure means: not usable
        print(f"  (Redis: {type(exc).__name__}: {exc})", file=sys.stderr)
        return False
    return True


def main() -> int:
    pg = postgres_up(os.environ.get("DATABASE_URL", ""))
    rd = redis_up(os.environ.get("REDIS_URL", ""))
    print(f"postgres={'up' if pg else 'down'} redis={'up' if rd else 'down'}")
    return 0 if pg and rd else 1


if __name__ == "__main__":
    sys.exit(main())
