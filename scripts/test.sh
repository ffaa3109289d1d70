#!/usr/bin/env bash
# Install, then run every check CI runs: the project's tests, the committed
# generated code being current, and the generated tests of every example.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/mpgen check  # the specs and folder of [tool.mpgen] in pyproject.toml
# Two workers, a test file to each at a time (about 1.5x faster than one on
# a 2-core machine); MPGEN_TEST_WORKERS=0 runs the suite in this process.
.venv/bin/python -m pytest -q -n "${MPGEN_TEST_WORKERS:-2}" --dist loadfile tests "$@"
.venv/bin/mpgen test -- -q  # the generated tests of [tool.mpgen]'s out (docs/ci.md)
