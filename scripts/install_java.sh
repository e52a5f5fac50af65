#!/usr/bin/env bash
# Installs Debian's Java 17 runtime for the `scienceworld` environment (its simulator is a
# Java program, one JVM per live game), if `java` is missing. Machines that step
# scienceworld episodes (the trainer for inline rollouts, each `worker-env`) need it.
set -euo pipefail
if command -v java >/dev/null 2>&1; then
    echo "java present: $(java -version 2>&1 | head -1)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_java.sh: need root (or sudo) to apt-get install openjdk-17-jre-headless" >&2
        exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends openjdk-17-jre-headless
java -version
