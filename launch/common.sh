# shellcheck shell=bash
# Shared by launch/torchrun.sh, launch/multinode.sh and slurm/dettrain.sbatch (sourced, not run).
#
#   dettrain_parse_args "$@"   split our own options (--nproc N) from the Hydra overrides, which land in ARGS
#   dettrain_setup_env         export the per-tier environment (python -m dettrain.tools.launch env) and pick NPROC
#
# The Python is $PYTHON (default: python3 on PATH); it must be the one dettrain is installed in.

export PYTHON=${PYTHON:-python3}
# torchrun --max-restarts: restarted workers must not reuse the dead attempt's store addresses (pytorch#135712;
# without this, 5 of 8 SIGKILL restarts failed here with "connectFullMesh ... Connection refused")
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

dettrain_say() { echo "[dettrain launch] $*" >&2; }

dettrain_parse_args() {
    NPROC=${NPROC_PER_NODE:-}
    ARGS=()
    while (($#)); do
        case $1 in
            --nproc) NPROC=${2:-"(none)"}; shift $(($# > 1 ? 2 : 1)) ;;
            --nproc=*) NPROC=${1#*=}; shift ;;
            --) shift; ARGS+=("$@"); break ;;
            *) ARGS+=("$1"); shift ;;
        esac
    done
}

dettrain_setup_env() {
    local exports
    # compose the config the run will see, so a tier set in +exp=NAME counts too; bad overrides stop us here
    exports=$("$PYTHON" -m dettrain.tools.launch env "${ARGS[@]}") || return 1
    eval "$exports"  # DETTRAIN_TIER, DETTRAIN_GPUS, DETTRAIN_RUN_DIR, thread counts, ... (see dettrain/tools/launch.py)
    if [[ -z $NPROC ]]; then
        NPROC=$((DETTRAIN_GPUS > 0 ? DETTRAIN_GPUS : 1))  # one process per GPU; one on a CPU-only machine
    fi
    if ! [[ $NPROC =~ ^[1-9][0-9]*$ ]]; then
        dettrain_say "error: --nproc / NPROC_PER_NODE must be a positive integer, got '$NPROC'"
        return 1
    fi
}
