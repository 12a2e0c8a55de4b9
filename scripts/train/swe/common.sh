# Shared by grpo.sh, opd.sh and mixed_dagger.sh (sourced, not run): reads the STACX_* variables
# (ENV_REFERENCE.md lists them), writes the built-in SWE tasks as prompt rows unless STACX_PROMPT_DATA
# names a file, and runs `stacx train` on Ray or `torchrun ... -m stacx.train` with the flags every
# SWE launcher shares plus the caller's: swe_train RECIPE [stacx train flags...]

STACX_MODEL=${STACX_MODEL:?set STACX_MODEL to the Hugging Face checkpoint folder of the policy}
STACX_LAUNCHER=${STACX_LAUNCHER:-ray}
STACX_NPROC=${STACX_NPROC:-1}
STACX_NUM_STEPS=${STACX_NUM_STEPS:-100}
STACX_MAX_TURNS=${STACX_MAX_TURNS:-20}
STACX_ROLLOUT_BATCH_SIZE=${STACX_ROLLOUT_BATCH_SIZE:-8}
STACX_N_SAMPLES_PER_PROMPT=${STACX_N_SAMPLES_PER_PROMPT:-4}
STACX_MAX_RESPONSE_LEN=${STACX_MAX_RESPONSE_LEN:-2048}
STACX_SANDBOX_BACKEND=${STACX_SANDBOX_BACKEND:-namespace}
STACX_PYTHON=${STACX_PYTHON:-python}

case "$STACX_LAUNCHER" in
  ray | torchrun) ;;
  *) echo "STACX_LAUNCHER=$STACX_LAUNCHER: use 'ray' (stacx train) or 'torchrun' (torchrun -m stacx.train)" >&2
     exit 2 ;;
esac

# STACX_PRINT_ONLY=1: print the commands (one per line, shell-quoted) instead of running them.
swe_run() {
  if [ "${STACX_PRINT_ONLY:-0}" = 1 ]; then
    printf '%q ' "$@"
    printf '\n'
  else
    "$@"
  fi
}

swe_train() {
  local algorithm=$1
  shift
  # A launcher is named for its recipe: a later --algorithm wins (stacx train reads the last), and says so.
  local previous="" given
  for given in "$@"; do
    if [ "$previous" = --algorithm ] && [ "$given" != "$algorithm" ]; then
      echo "$(basename "$0"): --algorithm $given overrides this launcher's recipe ($algorithm)" >&2
    fi
    case "$given" in --algorithm=*) [ "${given#--algorithm=}" != "$algorithm" ] &&
      echo "$(basename "$0"): ${given} overrides this launcher's recipe ($algorithm)" >&2 ;; esac
    previous=$given
  done
  local out=${STACX_OUT_DIR:-outputs/swe/$algorithm}
  local data=${STACX_PROMPT_DATA:-}
  if [ -z "$data" ]; then
    data=$out/swe_tasks.jsonl
    swe_run "$STACX_PYTHON" -m stacx tasks swe --out "$data" --max-turns "$STACX_MAX_TURNS" \
        --sandbox-backend "$STACX_SANDBOX_BACKEND"
  fi
  local flags=(--algorithm "$algorithm" --hf-checkpoint "$STACX_MODEL" --prompt-data "$data"
               --custom-module stacx.tasks.swe.environment --out "$out"
               --num-steps "$STACX_NUM_STEPS" --rollout-batch-size "$STACX_ROLLOUT_BATCH_SIZE"
               --n-samples-per-prompt "$STACX_N_SAMPLES_PER_PROMPT"
               --rollout-max-response-len "$STACX_MAX_RESPONSE_LEN" --data-parallel-size "$STACX_NPROC")
  if [ "$STACX_LAUNCHER" = torchrun ]; then
    swe_run torchrun --standalone --nproc-per-node "$STACX_NPROC" -m stacx.train "${flags[@]}" "$@"
  else
    swe_run "$STACX_PYTHON" -m stacx train "${flags[@]}" "$@"
  fi
}
