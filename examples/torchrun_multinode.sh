#!/bin/bash
# Single-role recipes (sft, dpo, opd with an external teacher) SPMD with torchrun, no Ray.
#
# Run the same command on every node (NODE_RANK 0..NNODES-1), MASTER_ADDR = node 0's address:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/torchrun_multinode.sh examples/configs/sft.yaml
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/torchrun_multinode.sh examples/configs/sft.yaml
# Under SLURM: srun --nodes=2 --ntasks-per-node=1 bash examples/torchrun_multinode.sh RUN_YAML
#
# World size = NNODES * NPROC_PER_NODE = tp * cp * dp; pass --data-parallel-size to match (below).
# The flags and checkpoints are those of `stacx train`; a run saved under torchrun resumes under
# Ray and the other way round.
set -euo pipefail

CONFIG=${1:?usage: $0 RUN_YAML [stacx train flags]}
shift
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
TP=${TP:-1}
CP=${CP:-1}
DP=$(( NNODES * NPROC_PER_NODE / (TP * CP) ))

torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m stacx.train --config "$CONFIG" \
    --tensor-model-parallel-size "$TP" --context-parallel-size "$CP" --data-parallel-size "$DP" "$@"
