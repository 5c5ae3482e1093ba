#!/usr/bin/env bash
# Creates (once) and refreshes the shared virtualenv under ~/.cache/headroom and links it as .venv.
# The venv is shared between clones so that CI's second run skips the multi-GB torch install;
# a stamp of the dependency lists decides when pip must run again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${HEADROOM_CACHE:-$HOME/.cache/headroom}
venv=$cache/venv
mkdir -p "$cache"
exec 9>"$cache/venv.lock"
flock 9

if [ ! -x "$venv/bin/python" ]; then
  echo "headroom: creating virtualenv in $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --cache-dir "$cache/pip" --upgrade pip setuptools wheel
fi

deps_hash=$(python3 - "$root/pyproject.toml" <<'PY'
import hashlib, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
blob = repr((p.get("dependencies"), p.get("optional-dependencies")))
print(hashlib.sha256(blob.encode()).hexdigest()[:16])
PY
)
stamp="$venv/.headroom-stamp"
want="$deps_hash $root"
have=$(cat "$stamp" 2>/dev/null || true)
# pip's setuptools chatter is noise on success; show the log only when it fails.
pip_quiet() {
  "$venv/bin/pip" "$@" >"$cache/pip.log" 2>&1 || { cat "$cache/pip.log" >&2; return 1; }
}
if [ "$have" != "$want" ]; then
  if [ "${have%% *}" = "$deps_hash" ]; then
    # Same dependencies, different checkout: only re-point the editable install.
    pip_quiet install -q --no-deps --cache-dir "$cache/pip" -e "$root"
  else
    echo "headroom: installing pinned dependencies (first run downloads torch, a few minutes)" >&2
    pip_quiet install -q --cache-dir "$cache/pip" -e "$root[dev]"
  fi
  echo "$want" >"$stamp"
fi
if [ "$(readlink "$root/.venv" 2>/dev/null)" != "$venv" ]; then
  rm -rf "$root/.venv"
  ln -s "$venv" "$root/.venv"
fi
