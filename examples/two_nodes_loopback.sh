#!/usr/bin/env bash
# Two "nodes" of two processes each on one machine (loopback), as a real two-node job runs:
# one torchrun per node, --nnodes 2 --node_rank 0/1, node 0's address as the rendezvous.
#
#   examples/two_nodes_loopback.sh --pp 2            # 4 ranks: pp=2 x dp=2, train_gpt.py
#   SCRIPT=other.py examples/two_nodes_loopback.sh ARGS...
#
# On a real cluster run the same torchrun line on each node with its own --node_rank and
# --master_addr set to node 0's hostname.
set -euo pipefail
SCRIPT=${SCRIPT:-examples/train_gpt.py}
PORT=${MASTER_PORT:-29531}
NPROC=${NPROC_PER_NODE:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
common=(--nnodes 2 --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port "$PORT")

python -m torch.distributed.run "${common[@]}" --node_rank 1 "$SCRIPT" "$@" &
node1=$!
# If node 0 fails, do not leave node 1 waiting for its peers.
trap 'kill "$node1" 2>/dev/null || true' EXIT
python -m torch.distributed.run "${common[@]}" --node_rank 0 "$SCRIPT" "$@"
wait "$node1"
trap - EXIT
