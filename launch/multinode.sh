#!/usr/bin/env bash
# Run launch/generate.py across nodes: start this on every node with the same MASTER_ADDR.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 GPUS_PER_NODE=4 launch/multinode.sh --model /models/qwen3 "Hello"
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 GPUS_PER_NODE=4 launch/multinode.sh --model /models/qwen3
# Ranks on different hosts receive each step over a torch.distributed (gloo) broadcast instead of
# shared memory; tensor-parallel all-reduces go over NCCL.
set -euo pipefail
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "${GPUS_PER_NODE:-1}" \
    --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
    "$(dirname "$0")/generate.py" "$@"
