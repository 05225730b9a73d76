"""Run the shared CLI contract check (../shared/contract/check.py) against a PostgreSQL store.

Uses the server in STEPWARDEN_TEST_POSTGRES (an admin URL) when set, else starts a throwaway one,
creates a fresh database, runs the check with ``--db``, and stops what it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psycopg

from stepwarden.testing.postgres import LocalPostgres


def main() -> int:
    check = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/contract/check.py")
    admin = os.environ.get("STEPWARDEN_TEST_POSTGRES")
    pg = None
    if not admin:
        pg = LocalPostgres(Path(tempfile.mkdtemp(prefix="stepwarden-contract-")) / "pgdata").start()
        admin = pg.url()
    db = f"contract_{uuid.uuid4().hex[:8]}"
    try:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{db}"')
        url = admin.rsplit("/", 1)[0] + "/" + db
        print(f"contract check on {url}", flush=True)
        return subprocess.call([sys.executable, str(check), "--db", url])
    finally:
        if pg is not None:
            pg.stop("immediate")


if __name__ == "__main__":
    sys.exit(main())
