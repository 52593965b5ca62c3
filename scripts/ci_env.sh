#!/usr/bin/env bash
# CI's environments (CPU machine): a virtualenv with exactly the packages a constraints file pins,
# cached outside the clone. Prints its python.
#
#   scripts/ci_env.sh [CONSTRAINTS]     (default: constraints-latest.txt)
#
# constraints.txt is the pinned stack (torch 2.11 + triton 3.6, the GPU machine's), and
# constraints-latest.txt the newest (what `pip install torch` gives today). Every line of the
# file is installed (`pip install -r`), so the file is the whole list, resolved from PyPI.
# The venv is ${SOLATTN_CI_CACHE:-$HOME/.cache/solattn-ci}/venv-<key>, key = hash of the
# constraints file and of the python version: changing a pin builds a new venv, otherwise the
# cached one is reused. It holds no solattn install (run it with PYTHONPATH=<clone>), so every
# fresh clone can use it. From PyPI torch is the CUDA build (the only Linux torch there) with
# its nvidia-* wheels, which import and run on a machine without a GPU: about 2.8 GB of
# downloads and 5.5 GB on disk per venv; on the 2-core CI machine one builds in 1-2 minutes
# and a cached one is checked in a few seconds. Wheels are not kept in pip's cache (a rebuild
# downloads again; the disk holds only the venvs). Venvs unused for 7 days are removed.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
constraints=${1:-constraints-latest.txt}
py=${PY:-python3}
cache=${SOLATTN_CI_CACHE:-$HOME/.cache/solattn-ci}
key=$({ cat "$constraints"; "$py" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
venv=$cache/venv-$key

mkdir -p "$cache"
if command -v flock >/dev/null; then
  exec 9>"$cache/lock"
  flock 9  # concurrent CI runs: one builds, the others wait for it and reuse the venv
fi
# `ready` is written last: a build that was interrupted is redone from the start.
if [ ! -f "$venv/ready" ] || ! "$venv/bin/python" -c "import torch, triton, numpy, pytest" \
    2>/dev/null; then
  start=$SECONDS
  echo "ci_env: building $venv from $constraints" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
    -r "$constraints" >&2
  "$venv/bin/python" -m pip check >&2
  "$venv/bin/python" -c "import torch, triton, numpy, pytest" >&2
  echo "$constraints" > "$venv/ready"
  echo "ci_env: built in $((SECONDS - start)) s" >&2
fi
touch "$venv/ready"
for old in "$cache"/venv-*; do
  if [ "$old" != "$venv" ] && [ -z "$(find "$old/ready" -mtime -7 2>/dev/null)" ]; then
    rm -rf "$old"
  fi
done
echo "$venv/bin/python"
