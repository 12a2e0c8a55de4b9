#!/usr/bin/env bash
# GRPO on SWE tasks: the policy fixes bugs through the `swe` environment's tools (bash, read_file,
# write_file, submit) in a sandbox; the reward is 1 when the task's hidden tests pass.
#   STACX_MODEL=CKPT bash scripts/train/swe/grpo.sh [stacx train flags, e.g. --dry-run]
#   STACX_LAUNCHER=torchrun STACX_NPROC=2 STACX_MODEL=CKPT bash scripts/train/swe/grpo.sh
# Variables: scripts/train/swe/ENV_REFERENCE.md.
set -euo pipefail
source "$(dirname "$0")/common.sh"
swe_train grpo --rollout-temperature 1.0 "$@"
