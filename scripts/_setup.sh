#!/usr/bin/env bash
# Shared set-up for ./scripts/demo and ./scripts/test: create or reuse .venv and install shardwise.
# torch: keep the one the user has (GPU and NPU users bring their own build); install the pinned CPU
# release only when torch is missing, so that pip never pulls a multi-GB CUDA build by accident.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv --system-site-packages .venv 2>/dev/null || "$PYTHON" -m venv .venv
fi
py=.venv/bin/python
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] torch missing: installing torch==2.13.0"
  "$py" -m pip install --quiet "torch==2.13.0"
fi
# The stamp holds the hash of pyproject.toml and the extras installed ("HASH test,dev"). A run is
# satisfied by an install with more extras than it needs: reinstall only when pyproject.toml changed
# or a needed extra is missing, and then keep the extras already there (so ./scripts/test and
# ./scripts/demo can alternate without reinstalling).
stamp=.venv/.shardwise-installed
hash="$(sha1sum pyproject.toml | cut -c1-40)"
old_hash="" have=""
if [ -f "$stamp" ]; then
  read -r old_hash have < "$stamp" || true
fi
extras="" missing=""
for e in ${have//,/ }; do
  extras="$extras,$e"
done
need="${SHARDWISE_EXTRAS:-}"
for e in ${need//,/ }; do
  case "$extras," in
    *",$e,"*) ;;
    *) extras="$extras,$e" missing="$missing,$e" ;;
  esac
done
extras="${extras#,}"
if [ "$old_hash" != "$hash" ] || [ -n "$missing" ]; then
  echo "[setup] installing shardwise${extras:+[$extras]} and its dependencies"
  "$py" -m pip install --quiet -e ".${extras:+[$extras]}"
  echo "$hash $extras" > "$stamp"
fi
