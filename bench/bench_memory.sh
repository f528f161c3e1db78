#!/usr/bin/env bash
# The 7B memory plan measured on one GPU (issue 13, "Speed and memory"): rank 0 of a fake 8-rank group runs real
# steps of dettrain's FSDP2Engine (communication excluded), at tiers 3 and 4, and reports the allocator peak, the
# breakdown and the step time / tokens/s / MFU.  Usage, from the repo root on the GPU machine:
#   OUT=/some/dir bash bench/bench_memory.sh [EXTRA OVERRIDES ...]
# Each run's full output goes to $OUT/memory_tier<T>.log; the last line of each is 'peak per rank: X GiB'.
# COMPARE=R: instead, R interleaved rounds of stock FSDP2 and the engine per tier (--compare-stock R), each run's
# summary appended to $OUT/runs.jsonl, the ratio table at the end of $OUT/compare_tier<T>.log (issue 26's goal).
# The CPU estimate of the same plan: python -m dettrain.memory +exp=llm_7b --nproc 8 --device cpu [det.tier=4]
set -u
OUT=${OUT:-/tmp/memory_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
for tier in 3 4; do
  echo "== llm_7b, 8 ranks, tier $tier"
  if [ -n "${COMPARE:-}" ]; then
    python3 -m dettrain.memory +exp=llm_7b --nproc 8 --device cuda --compare-stock "$COMPARE" --json "$OUT/runs.jsonl" \
      det.tier=$tier "$@" 2>&1 | tee "$OUT/compare_tier$tier.log" | tail -n $((COMPARE + 3))
  else
    python3 -m dettrain.memory +exp=llm_7b --nproc 8 --device cuda det.tier=$tier "$@" 2>&1 \
      | tee "$OUT/memory_tier$tier.log" | tail -n 20
  fi
done
