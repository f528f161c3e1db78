#!/usr/bin/env bash
# shellcheck disable=SC2153  # DETTRAIN_* are set by dettrain_setup_env
# Several nodes by hand: run this once on every node, with the same NNODES, MASTER_ADDR, MASTER_PORT and
# DETTRAIN_RUN_ID everywhere and each node's own NODE_RANK (0 .. NNODES-1):
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 DETTRAIN_RUN_ID=myrun \
#       launch/multinode.sh [--nproc N] [+exp=NAME] [key=value ...]      # on node 0 (MASTER_ADDR is its address)
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 DETTRAIN_RUN_ID=myrun \
#       launch/multinode.sh [--nproc N] [+exp=NAME] [key=value ...]      # on node 1
#
# Static rendezvous: node k holds global ranks k*N .. k*N+N-1, and node 0 hosts the rendezvous store on
# MASTER_ADDR:MASTER_PORT.  MASTER_ADDR must be node 0's address as the *other* nodes reach it (never a localhost
# default: on another node that is the wrong machine), and DETTRAIN_RUN_ID must be given: each node computing its own
# would put the ranks' files in different run dirs.  The run dir (outputs/<exp_name>/<run id>/ or run_dir=...) must
# be on a file system every node sees.  The per-tier environment is exported as in launch/torchrun.sh.
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

missing=()
for v in NNODES NODE_RANK MASTER_ADDR DETTRAIN_RUN_ID; do
    [[ -n ${!v:-} ]] || missing+=("$v")
done
if ((${#missing[@]})); then
    dettrain_say "error: set ${missing[*]} (the same on every node except NODE_RANK); see the header of $0"
    exit 2
fi
if ! ((NODE_RANK >= 0 && NODE_RANK < NNODES)); then
    dettrain_say "error: NODE_RANK=$NODE_RANK must lie in [0, NNODES=$NNODES)"
    exit 2
fi
MASTER_PORT=${MASTER_PORT:-29500}

export DETTRAIN_RUN_ID
dettrain_parse_args "$@"
dettrain_setup_env
dettrain_say "run dir $DETTRAIN_RUN_DIR, tier $DETTRAIN_TIER, node $NODE_RANK of $NNODES, $NPROC process(es) per node," \
    "rendezvous $MASTER_ADDR:$MASTER_PORT"
exec "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC" \
    --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" --max-restarts=0 \
    -m dettrain "${ARGS[@]}"
