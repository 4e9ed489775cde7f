#!/usr/bin/env bash
# The peers side by side (bench/README.md): a bench-only virtualenv, bench/.venv-peers (gitignored),
# with PGQueuer and Procrastinate from PyPI next to leasework itself, then bench/peers.py in it.
# They are never dependencies of leasework: only this script installs them, only there.
#
#   bench/peers.sh [--dsn DSN] [--quick] [...]               (arguments go to bench/peers.py)
#   bench/peers.sh async_io.py [--dsn DSN] [--quick] [...]   (another script of bench/ run there)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-peers"
stamp="$venv/.installed-1"
if [[ ! -f "$stamp" ]]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet 'pgqueuer>=0.19' 'procrastinate>=3' asyncpg uvloop
    "$venv/bin/python" -m pip install --quiet -e "$here/.."
    touch "$stamp"
fi
script=peers.py
if [[ $# -gt 0 && "$1" == *.py ]]; then
    script="$1"
    shift
    if [[ "$script" == */* || ! -f "$here/$script" ]]; then
        echo "peers.sh: no script $script in bench/ (e.g. async_io.py)" >&2
        exit 2
    fi
fi
exec "$venv/bin/python" "$here/$script" "$@"
