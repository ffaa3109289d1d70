#!/usr/bin/env bash
# Create .venv with mpgen and its test tools. torch is pinned first so pip
# takes the CPU build (pyproject keeps a range for users).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"
