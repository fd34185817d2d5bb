#!/usr/bin/env bash
# Fresh virtualenv, the package with its test extra, then the test suite.
# Extra arguments go to pytest (e.g. `tests/moe -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
exec .venv/bin/python -m pytest "$@"
