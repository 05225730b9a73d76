#!/usr/bin/env bash
# Install Debian's pgbouncer for the PgBouncer integration tests (tests/integration/test_pgbouncer.py),
# which start their own pgbouncer process in transaction pool mode. Idempotent: does nothing when it
# is there. Debian installs it as /usr/sbin/pgbouncer; the tests look there too. Installing enables
# a system service, which the tests neither need nor use (they never touch /etc/pgbouncer).
set -euo pipefail
PGBOUNCER="$(command -v pgbouncer || echo /usr/sbin/pgbouncer)"
if [ -x "$PGBOUNCER" ]; then
    echo "pgbouncer present: $("$PGBOUNCER" --version | head -1)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install-pgbouncer: need root (or sudo) to apt-get install pgbouncer" >&2; exit 1; }
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq pgbouncer >/dev/null
echo "pgbouncer installed: $(/usr/sbin/pgbouncer --version | head -1)"
