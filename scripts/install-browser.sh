#!/usr/bin/env bash
# Install Debian's chromium for the dashboard's browser tests (tests/dashboard/test_browser.py),
# which Playwright drives through executable_path. Idempotent: does nothing when it is there.
# Never `playwright install`: browsers come from the distribution's packages only.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    echo "chromium present: $(chromium --version 2>/dev/null || echo unknown version)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install-browser: need root (or sudo) to apt-get install chromium" >&2; exit 1; }
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium >/dev/null
echo "chromium installed: $(chromium --version 2>/dev/null || echo unknown version)"
