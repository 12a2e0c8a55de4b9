#!/usr/bin/env bash
# GRPO on SWE tasks with mini-swe-agent, unmodified, as the scaffold (--agent-command): each episode runs
# `python -m stacx.tasks.swe.mini_swe_agent`, which runs every command the policy chooses in a sandbox
# session on the task's repository, runs the task's tests once the agent submits, and reports the reward
# through the private file Stacx gives it. Needs mini-swe-agent (pip install mini-swe-agent).
#   STACX_MODEL=CKPT bash scripts/train/swe/mini_swe_agent.sh [stacx train flags, e.g. --dry-run]
#   STACX_LAUNCHER=torchrun STACX_MODEL=CKPT bash scripts/train/swe/mini_swe_agent.sh
# Variables: scripts/train/swe/ENV_REFERENCE.md.
set -euo pipefail
source "$(dirname "$0")/common.sh"
STACX_AGENT_TIMEOUT=${STACX_AGENT_TIMEOUT:-1800}
STACX_OUT_DIR=${STACX_OUT_DIR:-outputs/swe/mini_swe_agent}
agent=("$STACX_PYTHON" -m stacx.tasks.swe.mini_swe_agent)
if [ -n "${STACX_MINI_SWE_CONFIG:-}" ]; then
  agent+=(--config "$STACX_MINI_SWE_CONFIG")
fi
if [ -n "${STACX_TRAJECTORY_DIR:-}" ]; then
  agent+=(--trajectory-dir "$STACX_TRAJECTORY_DIR")
fi
agent_env=()
for name in ${STACX_AGENT_ENV:-}; do
  agent_env+=(--agent-env "$name")
done
swe_train grpo --rollout-temperature 1.0 --agent-command "$(printf '%q ' "${agent[@]}")" \
    --agent-timeout "$STACX_AGENT_TIMEOUT" ${agent_env[@]+"${agent_env[@]}"} "$@"
