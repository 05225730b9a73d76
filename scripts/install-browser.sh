#!/usr/bin/env bash
# Debian's chromium, for the dashboard's browser tests (tests/dashboard/test_browser.py), which
# Playwright drives through executable_path. See apt-install.sh.
exec bash "$(dirname "$0")/apt-install.sh" chromium
