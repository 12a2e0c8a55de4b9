#!/usr/bin/env bash
# Mixed-loss DAgger on SWE episodes (recipe mixture_dagger_opd): each turn is played by the teacher server
# with probability beta (decaying over training), else by the student; the student is trained by
# cross-entropy on the teacher's turns and reverse KL on its own. The teacher is a `stacx serve` server
# with the student's tokenizer. STACX_DAGGER_SAMPLING_MODE=kappa switches to the AggreVaTe roll-in.
#   STACX_MODEL=CKPT STACX_TEACHER_URL=http://127.0.0.1:30000 bash scripts/train/swe/mixed_dagger.sh [flags]
# Variables: scripts/train/swe/ENV_REFERENCE.md.
set -euo pipefail
source "$(dirname "$0")/common.sh"
STACX_TEACHER_URL=${STACX_TEACHER_URL:?set STACX_TEACHER_URL to the teacher server (stacx serve --no-weight-updates)}
swe_train mixture_dagger_opd --teacher-url "$STACX_TEACHER_URL" "$@"
