#!/usr/bin/env bash
# Install, then run every check CI runs: the project's tests, the committed
# generated code being current, and the generated tests of every example.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/mpgen check examples/*.yaml -o generated
.venv/bin/python -m pytest -q tests "$@"
.venv/bin/python -m pytest -q -p no:cacheprovider generated
