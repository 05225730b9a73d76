#!/usr/bin/env bash
# Debian's pgbouncer, for tests/integration/test_pgbouncer.py, which starts its own pgbouncer in
# transaction pool mode (Debian installs it as /usr/sbin/pgbouncer; the tests look there too).
# See apt-install.sh.
exec bash "$(dirname "$0")/apt-install.sh" pgbouncer
