#!/usr/bin/env bash
# Prints the path of the pinned uv, installing it (hash-checked) under ~/.cache/headroom once.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${HEADROOM_CACHE:-$HOME/.cache/headroom}
req="$root/scripts/uv-requirements.txt"
version=$(sed -n 's/^uv==\([^ ]*\).*/\1/p' "$req")
dir="$cache/tools/uv-$version"
if [ ! -x "$dir/bin/uv" ]; then
  mkdir -p "$cache/tools"
  exec 9>"$cache/tools/.uv.lock"
  flock 9
  if [ ! -x "$dir/bin/uv" ]; then
    echo "headroom: installing uv $version into $dir" >&2
    rm -rf "$dir"  # a half-finished earlier try
    python3 -m venv "$dir"
    "$dir/bin/pip" install -q --disable-pip-version-check --require-hashes \
      --cache-dir "$cache/pip" -r "$req" >&2
  fi
fi
echo "$dir/bin/uv"
