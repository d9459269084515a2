#!/usr/bin/env bash
# Run one config on two nodes with torchrun: start this script once on each node.
#
#   node 0:  examples/torchrun_two_nodes.sh 0 10.0.0.1 configs/demo_cpu.yaml
#   node 1:  examples/torchrun_two_nodes.sh 1 10.0.0.1 configs/demo_cpu.yaml
#
# Try it on one machine (two "nodes" on loopback, 2 processes each):
#
#   examples/torchrun_two_nodes.sh loopback configs/demo_cpu.yaml trainer.max_steps=50
#
# torchrun sets WORLD_SIZE / LOCAL_WORLD_SIZE; `lightning-pp fit` takes trainer.devices and
# trainer.num_nodes from them (and prints what it detected), so the config needs no edits.
# Extra arguments after the config are key=value overrides.
set -euo pipefail

NPROC=${NPROC_PER_NODE:-2}   # processes (GPUs) per node
PORT=${MASTER_PORT:-29500}

launch() {  # launch NODE_RANK MASTER_ADDR CONFIG [overrides...]
  local node_rank=$1 master=$2
  shift 2
  torchrun --nnodes 2 --node_rank "$node_rank" --nproc_per_node "$NPROC" \
    --master_addr "$master" --master_port "$PORT" \
    -m lightning_pp fit "$@"
}

if [[ ${1:-} == loopback ]]; then
  shift
  export OMP_NUM_THREADS=1
  launch 1 127.0.0.1 "$@" > torchrun_node1.log 2>&1 &
  node1=$!
  trap 'kill $node1 2>/dev/null || true' EXIT
  launch 0 127.0.0.1 "$@"
  wait $node1
  echo "node 1's output: torchrun_node1.log"
else
  launch "${1:?node rank (0 or 1)}" "${2:?master address}" "${@:3}"
fi
