"""Exit 0 when PostgreSQL (DATABASE_URL) and Redis (REDIS_URL) answer; the
database is created if the server is up but the database is missing."""

import os
import sys

import psycopg
import redis
from psycopg import sql


def main() -> int:
    database_url, redis_url = os.environ.get("DATABASE_URL", ""), os.environ.get("REDIS_URL", "")
    if not database_url.startswith(("postgres://", "postgresql://")) or not redis_url:
        return 1
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=2).ping()
        base, name = database_url.rsplit("/", 1)
        name = name.split("?", 1)[0]
        with psycopg.connect(f"{base}/postgres", connect_timeout=3, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except Exception as exc:  # any failure means: not usable, use embedded defaults
        print(f"  ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
