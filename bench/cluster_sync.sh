#!/bin/bash
# Gradient sync across the test cluster's nodes with every node's link shaped by tc.
#
#   bench/cluster_sync.sh RATE NODES grads|model [bench options...]
#
# RATE: tbf rate on each node's eth0 (outgoing), e.g. 1gbit or 200mbit; "none" for the
# bare veth. NODES: 2 or 4 (two ranks per node, partition `four` of bin/hpc-testcluster).
# grads: bench/gradsync_supernet.py with --iface eth0 (bytes each node sent);
# model: bench/sync_model.py with --link (one send across the link, the bound).
# The shaping is removed when it ends, however it ends. Needs root (tc in the namespaces).
# Example: flock /tmp/hpc-heavy.lock bench/cluster_sync.sh 1gbit 2 grads --batches 64
set -euo pipefail
RATE=${1:?rate (1gbit, 200mbit, none)}; NODES=${2:?nodes (2 or 4)}; WHAT=${3:?grads or model}
shift 3
case $WHAT in
    grads) BENCH=(gradsync_supernet.py --groups hpc --iface eth0) ;;
    model) BENCH=(sync_model.py --groups hpc --link) ;;
    *) echo "cluster_sync.sh: $WHAT: choose grads or model" >&2; exit 2 ;;
esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${HPC_PYTHON:-$ROOT/.venv/bin/python}
nodes=$(seq 1 "$NODES")

shape() {  # shape ACTION: add or del the root qdisc on each node's eth0
    for n in $nodes; do
        if [ "$1" = add ]; then
            # burst >= rate/HZ, or tbf cannot reach its rate; latency bounds the queue
            ip netns exec "hpc-node$n" tc qdisc replace dev eth0 root tbf rate "$RATE" \
                burst 1mb latency 100ms
        else
            ip netns exec "hpc-node$n" tc qdisc del dev eth0 root 2>/dev/null || true
        fi
    done
}

trap 'shape del' EXIT
shape del
[ "$RATE" = none ] || shape add
echo "# $NODES nodes x 2 ranks, each node's eth0: ${RATE}" \
     "($(ip netns exec hpc-node1 tc qdisc show dev eth0 | head -1))"
cd /tmp
PATH="$(dirname "$PY"):$PATH" HPC_ALLOW_CPU=1 PYTHONPATH="$ROOT" \
    srun -p four -N "$NODES" --ntasks-per-node=2 -t 15 "$PY" \
    "$ROOT/bench/${BENCH[0]}" "${BENCH[@]:1}" "$@"
