#!/usr/bin/env bash
# Create .venv with mpgen and its test tools. torch and torchvision are pinned
# first, as a pair built together: PyPI's torchvision loads its C++ operators
# only beside PyPI's torch of its release, and without them `import
# torchvision` fails, and with it transformers (pyproject keeps ranges for
# users). PyPI's pair is a CUDA build; it runs on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install --quiet -e ".[test]"
