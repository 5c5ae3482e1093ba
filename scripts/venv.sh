#!/usr/bin/env bash
# Installs this checkout's .venv exactly as uv.lock says (`uv sync --locked`): packages are
# hard-linked from the shared uv cache under ~/.cache/headroom, so a second clone costs seconds,
# and the project itself is an editable install of *this* checkout, so clones never import each
# other's code. Fails, naming `make lock`, when pyproject.toml changed without the lock.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${HEADROOM_CACHE:-$HOME/.cache/headroom}
uv=$("$root/scripts/uv.sh")

# An older layout linked .venv to a venv shared by every clone; replace the link with our own.
[ -L "$root/.venv" ] && rm -f "$root/.venv"

export UV_CACHE_DIR="$cache/uv" UV_PYTHON_DOWNLOADS=never UV_PROJECT_ENVIRONMENT="$root/.venv"
[ -d "$root/.venv" ] || echo "headroom: installing uv.lock into .venv (a cold cache downloads torch: minutes)" >&2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$uv" sync --project "$root" --locked --extra engine --extra sim --extra dev --extra cuda \
    --python "${HEADROOM_PYTHON:-python3.11}" >"$log" 2>&1; then
  cat "$log" >&2
  if grep -q "needs to be updated" "$log"; then
    echo "headroom: pyproject.toml changed but uv.lock was not regenerated: run 'make lock'" >&2
  fi
  exit 1
fi
