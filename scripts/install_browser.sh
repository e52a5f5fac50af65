#!/usr/bin/env bash
# Installs Debian's Chromium for the browser tests (tests/web/test_browser.py), if missing.
# Playwright (the PyPI package) drives it through executable_path=/usr/bin/chromium, so
# `playwright install` (which downloads browsers from the internet) is never needed.
set -euo pipefail
CHROMIUM="${OPENTINKER_CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
    echo "chromium present: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_browser.sh: need root (or sudo) to apt-get install chromium" >&2
        exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends chromium fonts-liberation
"$CHROMIUM" --version
