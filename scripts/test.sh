#!/usr/bin/env bash
# Install, then run every check CI runs: the project's tests, the committed
# generated code being current, and the generated tests of every example.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/mpgen check  # the specs and folder of [tool.mpgen] in pyproject.toml
.venv/bin/python -m pytest -q tests "$@"
.venv/bin/mpgen test -- -q  # the generated tests of [tool.mpgen]'s out (docs/ci.md)
