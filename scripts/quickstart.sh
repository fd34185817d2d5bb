#!/usr/bin/env bash
# The README's main job on a fresh machine: install what is missing, then run the offline
# sparse-upcycling story (python -m upcycle.quickstart). Arguments go to the quickstart.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import upcycle, seqio' 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -e .
fi
export TF_CPP_MIN_LOG_LEVEL=3
exec .venv/bin/python -m upcycle.quickstart "$@"
