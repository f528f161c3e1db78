#!/usr/bin/env bash
# shellcheck disable=SC2153  # DETTRAIN_* are set by dettrain_setup_env
# One node, N processes (one per GPU by default; 1 on a CPU-only machine):
#
#   launch/torchrun.sh [--nproc N] [+exp=NAME] [key=value ...]
#
# Every Hydra override is passed through to `python -m dettrain`.  All ranks share one run id (DETTRAIN_RUN_ID,
# default: a timestamp), so the run lands in outputs/<exp_name>/<run id>/ unless run_dir=... is given; export
# DETTRAIN_RUN_ID yourself to pick the name or to continue a run with ckpt.resume=auto.  The per-tier environment
# (thread counts, CUBLAS_WORKSPACE_CONFIG, NCCL_NVLS_ENABLE) is exported before torchrun starts the workers.
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

dettrain_parse_args "$@"
export DETTRAIN_RUN_ID=${DETTRAIN_RUN_ID:-$(date +%Y%m%d-%H%M%S)-$$}
dettrain_setup_env
dettrain_say "run dir $DETTRAIN_RUN_DIR, tier $DETTRAIN_TIER, $NPROC process(es) on this node"
exec "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NPROC" \
    -m dettrain "${ARGS[@]}"
