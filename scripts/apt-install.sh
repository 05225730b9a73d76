#!/usr/bin/env bash
# Install the Debian packages some tests need (CI: chromium for the dashboard's browser test,
# pgbouncer for the transaction-pooler tests) with ONE `apt-get update` for all of them.
# Idempotent: packages already installed are left alone. Browsers come from the distribution's
# packages only, never `playwright install`. Installing pgbouncer enables a system service that the
# tests neither need nor touch (they start their own pgbouncer with their own configuration).
set -euo pipefail
missing=()
for pkg in "$@"; do
    if dpkg -s "$pkg" >/dev/null 2>&1; then
        echo "$pkg present: $(dpkg-query -W -f='${Version}' "$pkg")"
    else
        missing+=("$pkg")
    fi
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "apt-install: need root (or sudo) to apt-get install ${missing[*]}" >&2; exit 1; }
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
for pkg in "${missing[@]}"; do
    echo "$pkg installed: $(dpkg-query -W -f='${Version}' "$pkg")"
done
