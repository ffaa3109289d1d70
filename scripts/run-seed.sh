#!/usr/bin/env bash
# The main job: install, build the seed example (the tutorial's two-GPU
# model) for this machine's CPU, and run its generated training script.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/mpgen build examples/seed.yaml --device-map cpu -o build/seed-cpu
.venv/bin/python build/seed-cpu/train_simple_model.py --steps 20 --log-every 5 "$@"
