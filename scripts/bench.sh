#!/usr/bin/env bash
# The benchmarks: install (the test tools and the bench extra: Accelerate,
# for the placement comparison), then measure every table and write
# docs/benchmarks.md (about 10 minutes on a 2-core machine). Arguments go to
# `python -m bench` (e.g. --only build,overhead, --quick, --rounds 7).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m pip install --quiet -e ".[test,bench]"
exec .venv/bin/python -m bench "$@"
