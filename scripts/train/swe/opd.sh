#!/usr/bin/env bash
# On-policy distillation on SWE episodes: the student plays the `swe` environment, a teacher server
# (`stacx serve --hf-checkpoint TEACHER --no-weight-updates`, same tokenizer) scores every student token,
# and the loss is the reverse KL to the teacher.
#   STACX_MODEL=CKPT STACX_TEACHER_URL=http://127.0.0.1:30000 bash scripts/train/swe/opd.sh [flags]
# Variables: scripts/train/swe/ENV_REFERENCE.md.
set -euo pipefail
source "$(dirname "$0")/common.sh"
STACX_TEACHER_URL=${STACX_TEACHER_URL:?set STACX_TEACHER_URL to the teacher server (stacx serve --no-weight-updates)}
swe_train opd --teacher-url "$STACX_TEACHER_URL" "$@"
