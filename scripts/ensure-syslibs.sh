#!/usr/bin/env bash
# Mooncake's wheel links against libibverbs/librdmacm/libnuma even for protocol "tcp".
# Install Debian's packages only when the import actually fails (idempotent, quiet when satisfied).
set -euo pipefail
py=${1:-.venv/bin/python}
if "$py" -c 'import mooncake.engine' >/dev/null 2>&1; then
  exit 0
fi
pkgs="libibverbs1 librdmacm1 libnuma1"
echo "mooncake.engine does not import; installing Debian packages: $pkgs" >&2
if [ "$(id -u)" -eq 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
  echo "error: need root (or sudo) to run: apt-get install -y $pkgs" >&2; exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
"$py" -c 'import mooncake.engine' || { echo "error: mooncake.engine still fails to import" >&2; exit 1; }
