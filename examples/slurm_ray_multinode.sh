#!/bin/bash
# Stacx on a Ray cluster spanning the nodes of a SLURM allocation.
#
#   sbatch examples/slurm_ray_multinode.sh examples/configs/grpo.yaml [extra stacx train flags]
#
# The first node runs the Ray head, every other node joins it, then `stacx train` runs on the
# head with --ray-address: the run's role workers are placed across all nodes (one placement
# bundle per rank: NUM_CPUS_PER_RANK CPUs and NUM_GPUS_PER_RANK GPUs).
#SBATCH --job-name=stacx
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=04:00:00
set -euo pipefail

CONFIG=${1:?usage: sbatch $0 RUN_YAML [stacx train flags]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CPUS_PER_NODE=${CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-32}}
RAY_PORT=${RAY_PORT:-6379}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]}
HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{print $1}')
ADDRESS="$HEAD_IP:$RAY_PORT"
echo "stacx: Ray head on $HEAD ($ADDRESS), ${#NODES[@]} nodes"

srun --nodes=1 --ntasks=1 -w "$HEAD" \
    ray start --head --node-ip-address="$HEAD_IP" --port="$RAY_PORT" \
    --num-cpus="$CPUS_PER_NODE" --num-gpus="$GPUS_PER_NODE" --block &
sleep 15
for node in "${NODES[@]:1}"; do
    srun --nodes=1 --ntasks=1 -w "$node" \
        ray start --address="$ADDRESS" --num-cpus="$CPUS_PER_NODE" --num-gpus="$GPUS_PER_NODE" --block &
done
sleep 15

# Data parallel across every GPU of the allocation; raise TP/CP in the config for large models.
srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" \
    python -m stacx.train --config "$CONFIG" --ray-address "$ADDRESS" \
    --num-gpus-per-rank 1 --num-cpus-per-rank "$((CPUS_PER_NODE / GPUS_PER_NODE))" "$@"
