#!/usr/bin/env bash
# One device session of the GPU benchmarks (BENCHMARKS.md, "GPU (H200)").  Usage, from the repo root:
#   OUT=/some/dir bash bench/gpu_session.sh [STAGE ...]
# Stages (default: all, in this order): tests fp inv ops verify t125a t125 t1b l7b; others by name (rowsum,
# attnsweep, ...).  torch.compile (issue 14), one stage per device command (each fits in 10 minutes): ctests c125
# c1b l7bc.  Issue 26's 7B comparison against stock FSDP2: s7b3 s7b4; its profiles: p7b; the GPU tests of its
# norm, clip and AdamW changes: ntests, etests; of the bf16 rows and the finishing pass: rtests; cuDNN's forward with
# dettrain's backward: cfwd, and its GPU tests: atests; the 125m / 1b comparisons against compiled tier 0: i125 i1b;
# the attention kernels' launch order: ltests, acmp, acmp2, acmp3, gtests; tier 4 offloaded: otests, o1b; 7B
# without resharding after forward: r7b; the FSDP2 engine's partials in host memory: ftests, fmut, f7bk, f7bo; the
# attention backward's dS in slices and 7B with two sequences a micro-batch: stests, acmp7, m7b; the head-size-128
# backward's block shapes at the 7B shapes: asw7, acmp8.  Generation (issue 45): gentests gensweep genbench genunfused genprof;
# the peak's live allocations at tiers 0/3/4 (issue 41): peak; one grid cell: grid; 7B through the trainer's step: t7b;
# tier 4's flat offload with every partial on the host: offl; with one copy stream per direction: offl2, offl2b;
# FSDP2 on one GPU with CUDA graphs forced on: fsdpcg, and keeping its gathered parameters: fsdpcg2; FSDP2 on one GPU
# under CUDA graphs at the default config (its GPU tests): fgraphs; beside flat tier 3: fgrid; as one FSDP2 unit: funits;
# the whole grid over several calls (bench_grid --budget/--resume): fullgrid; two profiled steps of the trainer at
# tiers 0, 3, 4 (1b micro-batch 1): prof1b; the attention backward's dK/dV pass with GQA groups split: asplit,
# and through the CLI: asgrid; train.overlap_steps, its GPU tests and through the CLI (the default beside serial
# steps, variants t0 t0s t3 t3s unless GRID_VARIANTS says): ovtests, ovgrid; two
# serial tier-0 runs of its test's job, diffed: t0rerun; the host's part of each step (bench/host_step.py): hoststep;
# the FSDP2 engine's AdamW hashing what it stores (DETTRAIN_FP_FUSED=1): fftests, ffgrid.
# Each stage's
# output is appended to $OUT/session.log and its measurements to $OUT/results.jsonl; a stage is skipped once the
# session has run BUDGET seconds.
# Missing Python packages travel as wheels in .whl/ (hydra-core, omegaconf, antlr4 on the lent machine; the wandb
# client too for the t0w / t3w variants and hoststep's mirror): `[WANDB=1] bash bench/device_wheels.sh` fetches them.
set -u
OUT=${OUT:-/tmp/gpu_out}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
J="--json $OUT/results.jsonl"
B="python3 bench/bench_gpu.py $J"
stage() {  # stage NAME TIMEOUT COMMAND...
  local name=$1 t=$2
  shift 2
  if [ "$SECONDS" -ge "$BUDGET" ]; then echo "== $name skipped (session at ${SECONDS}s)"; return; fi
  echo "== $name (t=${SECONDS}s): $*"
  timeout "$t" "$@" > "/tmp/stage_$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc (t=${SECONDS}s)"
  { echo "===== $name rc=$rc: $*"; cat "/tmp/stage_$name.log"; } >> "$OUT/session.log"
  tail -n "${TAILN:-12}" "/tmp/stage_$name.log"
}
run_stage() {
  case $1 in
    tests) stage tests 300 python3 -m pytest tests/test_fingerprint_gpu.py tests/test_batch_invariant_gpu.py \
             tests/test_rowsum_gpu.py tests/test_norm_gpu.py -q \
             -p no:cacheprovider -rfE ;;
    ntests) stage ntests 200 python3 -m pytest tests/test_norm_gpu.py tests/test_fingerprint_gpu.py -q \
              tests/test_batch_invariant_gpu.py::test_adamw_many_equals_one_update_per_tensor_bitwise \
              tests/test_batch_invariant_gpu.py::test_fused_adamw_equals_torch_reference_bitwise -p no:cacheprovider -rfE ;;
    rtests) stage rtests 200 python3 -m pytest tests/test_rowsum_gpu.py tests/test_norm_gpu.py -q -p no:cacheprovider \
              -rfE ;;
    cfwd) stage cfwd 150 $B attn-cudnn-fwd ;;
    # issue 26, sixth session: the attention kernels launched longest-first (kernels/attention.py ``_launch``): its
    # GPU tests, then the backward against cuDNN's and the per-head order, with block variants that keep the bits
    ltests) stage ltests 240 python3 -m pytest tests/test_attention_bwd_gpu.py tests/test_attention_fwd_gpu.py -q \
              -p no:cacheprovider -rfE ;;
    acmp) stage acmp 240 $B attn-cmp --shapes 1b 125m 7b --rounds 3 --extra dkdv:64,128,8,3 dkdv:64,128,4,3 \
            dkdv:64,64,8,3 dkdv:64,32,4,4 dq:128,64,8,3 dq:64,64,8,3 ;;
    acmp2) stage acmp2 200 $B attn-cmp --shapes 125m 7b 1b --rounds 4 ;;
    acmp3) stage acmp3 120 $B attn-cmp --shapes 1b --rounds 5 ;;
    gtests) stage gtests 300 python3 -m pytest tests/test_attention_bwd_gpu.py::test_launch_order_changes_no_bit tests/test_attention_gpu.py \
              tests/test_batch_invariant_gpu.py -q -p no:cacheprovider -rfE ;;
    atests) stage atests 240 python3 -m pytest tests/test_attention_fwd_gpu.py tests/test_attention_bwd_gpu.py \
              tests/test_norm_gpu.py tests/test_attention_gpu.py -k "not rerun_identically" -q -p no:cacheprovider \
              -rfE ;;
    # issue 26's 125m / 1b goals: tiers 3 and 4 (and FSDP2 tier 3 at world 1) against compiled tier 0, each twice,
    # interleaved, in one process per model
    i125) stage i125 300 $B compile --models 125m --variants tier0 tier3 tier4 tier3-fsdp2 tier0 tier3 tier4 \
            tier3-fsdp2 --steps 10 --warmup 3 --out "$OUT/i125" ;;
    i1b) stage i1b 300 $B compile --models 1b --variants tier0 tier3 tier4 tier3-fsdp2 tier0 tier3 tier4 \
           tier3-fsdp2 --steps 10 --warmup 3 --no-rerun --out "$OUT/i1b" ;;
    # issue 26, sixth session: the 1b goals with the final attention launch order, and tier 4 with its partial sum
    # in host memory (dist.offload_partials): peak, time, and the same bits as tier 4
    otests) stage otests 200 python3 -m pytest tests/test_offload_gpu.py -q -p no:cacheprovider -rfE ;;
    o1b) stage o1b 300 $B compile --models 1b --variants tier0 tier3 tier4 tier4-offload tier0 tier3 tier4 \
           tier4-offload --steps 10 --warmup 3 --no-rerun --out "$OUT/o1b" ;;
    etests) stage etests 240 python3 -m pytest tests/test_engines.py -k gpu -q -p no:cacheprovider -rfE ;;
    ctests) stage ctests 300 python3 -m pytest tests/test_compile_gpu.py -q -p no:cacheprovider -rfE ;;
    c125) stage c125 570 $B compile --models 125m --bi-both --out "$OUT" ;;
    c1b) stage c1b 570 $B compile --models 1b --bi-both --out "$OUT/1b" ;;
    l7bc) stage l7bc 300 $B llm7b --layers 2 4 --ckpt 0 --compile true ;;
    fp) stage fp 90 $B fp --sweep ;;
    rowsum) stage rowsum 90 $B rowsum ;;
    inv) stage inv 90 $B invariance ;;
    ops) stage ops 180 $B ops ;;
    opsweep) stage opsweep 180 $B ops --sweep ;;
    verify) stage verify 150 python3 -m dettrain.verify model=125m det.tier=3 det.batch_invariant=true --dtypes bf16 \
              --repeats 3 --json "$OUT/verify.json" ;;
    attnsweep) stage attnsweep 120 $B attn-sweep ;;
    mmsweep) stage mmsweep 120 $B ops --parts mm --sweep ;;
    t1b_ws) CUBLAS_WORKSPACE_CONFIG=:4096:8 stage t1b_ws 120 $B tiers --model 1b --tiers 2 3 --steps 5 --warmup 2 \
              --fp-on-only ;;
    t1b_attn) stage t1b_attn 120 $B tiers --model 1b --tiers 2 3 --steps 5 --warmup 2 --fp-on-only --attention triton ;;
    t125a) stage t125a 150 $B tiers --model 125m_anchor --tiers 0 2 3 4 --bi-both --profile 0 3 ;;
    t125a_ws) CUBLAS_WORKSPACE_CONFIG=:4096:8 stage t125a_ws 120 $B tiers --model 125m_anchor --tiers 2 3 ;;
    t125) stage t125 150 $B tiers --model 125m --tiers 0 2 3 4 --bi-both --steps 5 --warmup 2 ;;
    t1b) stage t1b 200 $B tiers --model 1b --tiers 0 2 3 4 --bi-both --steps 5 --warmup 2 ;;
    l7b) stage l7b 150 $B llm7b --layers 2 4 --ckpt 1 0 ;;
    # issue 26's 7B goal: stock FSDP2 against the engine, two interleaved rounds, one tier per device command
    s7b3) stage s7b3 570 python3 -m dettrain.memory +exp=llm_7b --nproc 8 --device cuda --compare-stock 2 \
            --json "$OUT/results.jsonl" det.tier=3 ;;
    s7b4) stage s7b4 570 python3 -m dettrain.memory +exp=llm_7b --nproc 8 --device cuda --compare-stock 2 \
            --json "$OUT/results.jsonl" det.tier=4 ;;
    # issue 26: the same without resharding after forward (one all-gather per block and micro-batch, not two)
    r7b) for t in 3 4; do
           stage "r7b$t" 400 python3 -m dettrain.memory +exp=llm_7b --nproc 8 --device cuda --compare-stock 1 \
             --json "$OUT/results.jsonl" det.tier=$t dist.reshard_after_forward=false
         done ;;
    # issue 26: one profiled step of stock FSDP2 and of tier 3 at 7B (op tables, gzipped Chrome traces), tier 4 timed
    # (P7B_EXTRA: overrides for all three; P7B_NO4=1: no tier-4 run)
    p7b) for v in "--stock" "det.tier=3"; do
           n=$(echo "$v" | tr -dc 'a-z0-9')
           stage "p7b_$n" 280 python3 -m dettrain.memory +exp=llm_7b --nproc 8 --device cuda --json "$OUT/results.jsonl" \
             --profile "$OUT/prof_$n.txt" $v ${P7B_EXTRA:-}
           gzip -f "$OUT/prof_$n.txt.trace.json"
         done
         [ -n "${P7B_NO4:-}" ] || stage p7b_tier4 200 python3 -m dettrain.memory +exp=llm_7b --nproc 8 --device cuda \
           --json "$OUT/results.jsonl" det.tier=4 ${P7B_EXTRA:-} ;;
    # issue 26, ninth session: the FSDP2 engine's tier-4 counters in host memory (dist.offload_partials): its GPU
    # tests, the same tests with the side stream's ordering broken (each must fail), and 7B with the whole counter
    # (--rounds all: 32 micro-batches a rank) kept on the device, then offloaded against stock FSDP2
    ftests) stage ftests 300 python3 -m pytest tests/test_offload_gpu.py tests/test_engines.py -k "gpu" -q \
              -p no:cacheprovider -rfE ;;
    otests2) stage otests2 200 python3 -m pytest tests/test_offload_gpu.py -q -p no:cacheprovider -rfE ;;
    fmut) cp dettrain/sync/offload.py /tmp/offload.py.orig
          for m in 's/^            dev.record_stream(self.side)  # its memory is reusable.*/            pass/' \
                   's/^        cur.wait_event(done)$/        pass/'; do
            sed -i "$m" dettrain/sync/offload.py
            cmp -s dettrain/sync/offload.py /tmp/offload.py.orig && echo "== fmut: $m changed nothing"
            stage fmut 200 python3 -m pytest tests/test_offload_gpu.py -k "host_counter or give_the_bits_of_the_device_ones" \
              -q -p no:cacheprovider
            cp /tmp/offload.py.orig dettrain/sync/offload.py
          done ;;
    f7bk) stage f7bk 420 python3 -m dettrain.memory +exp=llm_7b --nproc 8 --device cuda --rounds all --steps 1 \
            --json "$OUT/results.jsonl" det.tier=4 ;;
    f7bo) stage f7bo 580 python3 -m dettrain.memory +exp=llm_7b --nproc 8 --device cuda --rounds all --steps 1 \
            --compare-stock ${ROUNDS:-2} --json "$OUT/results.jsonl" det.tier=4 dist.offload_partials=true ;;
    # issue 26, tenth session: the attention backward's dS in slices past DS_MAX_BYTES (its GPU tests)
    stests) stage stests 240 python3 -m pytest tests/test_attention_bwd_gpu.py -q -p no:cacheprovider -rfE ;;
    # ... and the backward at the 7B shape with two sequences: 1.02 GiB of dS in two slices (cap 1 GiB) or one launch
    # (cap 2 GiB, the default since; when measured, the default was the 1 GiB cap)
    acmp7) stage acmp7 200 $B attn-cmp --shapes 7b2 7b --rounds 3 --extra cap:1 cap:2 ;;
    # issue 26, eleventh session: the backward's block shapes at the 7B micro-batch of two (dK/dV, dQ)
    asw7) stage asw7 300 $B attn-cmp --shapes 7b2 --rounds 3 --extra dkdv:32,64,4,3 dkdv:64,64,4,3 dkdv:64,64,8,3 \
            dkdv:32,64,8,4 dkdv:16,64,4,4 dkdv:32,128,8,3+dq:64,128,8,3 dkdv:64,128,8,2+dq:64,128,8,2 \
            dq:128,64,8,3 dq:32,64,4,4 ;;
    # ... and the dQ pass's blocks at both 7B micro-batches, the old default (64,64,4,4) against (128,64,8,3)
    acmp8) stage acmp8 200 $B attn-cmp --shapes 7b 7b2 --rounds 4 --extra dq:64,64,4,4 dq:128,64,8,3 ;;
    # issue 26, tenth session: 7B with two sequences a micro-batch (train.micro_batch=2: half the per-micro-batch
    # work of FSDP2 and the engine per token), stock against each tier, ROUNDS interleaved process pairs (default 1);
    # M7B_EXTRA adds overrides
    m7b) for t in ${TIERS:-3 4}; do
           stage "m7b$t" 560 python3 -m dettrain.memory +exp=llm_7b --nproc 8 --device cuda --compare-stock ${ROUNDS:-1} \
             --json "$OUT/results.jsonl" det.tier=$t train.micro_batch=2 ${M7B_EXTRA:-}
         done ;;
    # issue 45 (generation): its GPU tests, the few-row matmul tiles (bits against the training tile, and time),
    # decode and prefill against HF generate at batch 1, 8, 64, a profiled call at each of PROF_BATCHES (8)
    gentests) stage gentests 300 python3 -m pytest tests/test_generate_gpu.py -q -p no:cacheprovider -rfE ;;
    gensweep) stage gensweep 120 python3 bench/bench_generate.py --mm-sweep ;;
    genbench) stage genbench 300 python3 bench/bench_generate.py --batches 1,8,64 --json "$OUT/generate.jsonl" ;;
    genprof) for b in ${PROF_BATCHES:-8}; do stage genprof$b 200 python3 bench/bench_generate.py --profile $b --new 32 --trace-dir "$OUT"; done ;;
    # the decode path without LlamaStepper.FUSED (the training forward's modules one by one), for comparison
    genunfused) stage genunfused 300 python3 bench/bench_generate.py --batches 1,8,64 --unfused --json "$OUT/generate.jsonl" ;;
    # issue 41: what is live at the peak of device memory, tier 0 / 3 / 4 (TIERS), 125m micro-batch 4 through the CLI
    # (PEAK_MODEL, PEAK_GB, PEAK_MICRO to change: e.g. 1b, 16, 1)
    peak) for t in ${TIERS:-0 3 4}; do
            stage "peak$t" 120 python3 bench/peak_breakdown.py --top 22 -- model=${PEAK_MODEL:-125m} \
              train.global_batch=${PEAK_GB:-64} train.micro_batch=${PEAK_MICRO:-4} train.steps=3 log.every=1 \
              ckpt.final=false log.wandb.mode=disabled run_dir=/tmp/peak$t det.tier=$t
          done ;;
    # issue 41: one grid cell through the CLI (GRID_MODELS, GRID_MICRO, GRID_VARIANTS, ROUNDS; default: 125m at
    # micro-batch 4 with tier 4 kept and offloaded, the point whose peaks miss their goal)
    grid) stage grid 560 python3 bench/bench_grid.py --models ${GRID_MODELS:-125m} --micro ${GRID_MICRO:-4} \
            --variants ${GRID_VARIANTS:-t0 t3 t4 t4o} --rounds ${ROUNDS:-2} --steps 10 \
            --out "$OUT/grid_$(echo ${GRID_MODELS:-125m}_${GRID_MICRO:-4} | tr ' ' _).md" ;;
    # issue 41 item 5: 7B through the trainer's own step (dettrain.memory's measure mode runs Trainer.train_step)
    # against stock FSDP2 + compile, micro-batch 1 and 2, tier 3 (TIERS to change)
    # T7B_MICRO: the micro-batches (default 1 2); T7B_EXTRA: more overrides for dettrain's side, e.g.
    # train.overlap_steps=true (with DETTRAIN_FP_STREAM=1 in the environment for the side stream)
    t7b) for t in ${TIERS:-3}; do
           for mb in ${T7B_MICRO:-1 2}; do
             stage "t7b${t}m$mb" 560 python3 -m dettrain.memory +exp=llm_7b --nproc 8 --device cuda --compare-stock \
               ${ROUNDS:-1} --json "$OUT/results.jsonl" det.tier=$t train.micro_batch=$mb ${T7B_EXTRA:-}
           done
         done ;;
    # issue 41: tier 4's flat offload with every partial on the host: its GPU test, its peak at 125m micro-batch 4
    # (the 17.70 GiB defect of the old form), then its speed beside tier 0 and tier 4 kept on the device
    offl) stage otests 240 python3 -m pytest tests/test_offload_gpu.py -q -p no:cacheprovider -rfE
          stage peak4o 150 python3 bench/peak_breakdown.py --top 16 -- model=125m train.global_batch=64 \
            train.micro_batch=4 train.steps=3 log.every=1 ckpt.final=false log.wandb.mode=disabled \
            run_dir=/tmp/peak4o det.tier=4 dist.offload_partials=true
          stage grid4o 400 python3 bench/bench_grid.py --models 125m --micro 4 --variants t0 t4 t4o --rounds 1 \
            --steps 10 --out "$OUT/grid_125m_4_offload.md" ;;
    # issue 41: the flat offload's copies on one side stream (t4o1, DETTRAIN_OFFLOAD_STREAMS=1; the default when
    # this was measured, then named t4o) or one per direction (t4o2, now the default): the GPU tests of both forms,
    # then their speed beside tier 0 (two rounds at 125m micro-batch 4; offl2b: 1b micro-batch 2, one round)
    offl2) stage otests2s 300 python3 -m pytest tests/test_offload_gpu.py -q -p no:cacheprovider -rfE
           stage grid4o2 420 python3 bench/bench_grid.py --models 125m --micro 4 --variants t0 t4o1 t4o2 --rounds 2 \
             --steps 10 --out "$OUT/grid_125m_4_streams.md" ;;
    offl2b) stage grid1bo2 420 python3 bench/bench_grid.py --models 1b --micro 2 --variants t0 t4o1 t4o2 --rounds 1 \
              --steps 10 --out "$OUT/grid_1b_2_streams.md" ;;
    # issue 41, FSDP2 on one GPU without CUDA graphs (0.22-0.46x flat tier 3): why graphs do not help it.  The
    # engine's cuda_graphs flag forced on in a copy of the tree (FSDP2 frees and re-gathers its unsharded parameters,
    # so their addresses may move), cudagraph trees' log of re-records and skips, 125m micro-batch 8, tier 3
    fsdpcg) rm -rf /tmp/fcg && cp -r "$PWD" /tmp/fcg && sed -i 's/^    canonical_bits = True$/&\n    cuda_graphs = True/' \
              /tmp/fcg/dettrain/sync/engines/fsdp2.py && grep -c "cuda_graphs = True" /tmp/fcg/dettrain/sync/engines/fsdp2.py
            for cg in false true; do
              stage "fsdpcg_$cg" 200 env -C /tmp/fcg PYTHONPATH=/tmp/site:/tmp/fcg TORCH_LOGS=cudagraphs,perf_hints \
                python3 -m dettrain model=125m train.global_batch=64 train.micro_batch=8 train.steps=8 log.every=1 \
                ckpt.final=false log.wandb.mode=disabled run_dir=/tmp/fcg_run_$cg det.tier=3 dist.engine=fsdp2 \
                train.cuda_graphs=$cg
            done ;;
    # issue 41: FSDP2 on one rank keeps its gathered parameters' memory between steps (engines/fsdp2.py
    # ``keep_gathered``); with the engine's cuda_graphs flag forced on in a copy: the count of graph re-records,
    # then FSDP2 tier 3 with graphs off and on beside flat tier 3 (tokens/s, param fingerprints), 125m micro-batch 8
    fsdpcg2) rm -rf /tmp/fcg && cp -r "$PWD" /tmp/fcg && sed -i 's/^    canonical_bits = True$/&\n    cuda_graphs = True/' \
              /tmp/fcg/dettrain/sync/engines/fsdp2.py
             A="model=125m train.global_batch=64 train.micro_batch=8 train.steps=10 log.every=1 ckpt.final=false"
             A="$A log.wandb.mode=disabled det.tier=3"
             stage fcg_log 200 env -C /tmp/fcg PYTHONPATH=/tmp/site:/tmp/fcg TORCH_LOGS=cudagraphs python3 -m dettrain \
               $A run_dir=/tmp/fcgl dist.engine=fsdp2 train.cuda_graphs=true
             grep -c "data pointer changed" /tmp/stage_fcg_log.log
             for r in 1 2; do
               stage "fcg_flat$r" 150 python3 -m dettrain $A run_dir=/tmp/fcgf$r dist.engine=flat
               stage "fcg_off$r" 150 env -C /tmp/fcg PYTHONPATH=/tmp/site:/tmp/fcg python3 -m dettrain $A \
                 run_dir=/tmp/fcgo$r dist.engine=fsdp2 train.cuda_graphs=false
               stage "fcg_on$r" 150 env -C /tmp/fcg PYTHONPATH=/tmp/site:/tmp/fcg python3 -m dettrain $A \
                 run_dir=/tmp/fcgn$r dist.engine=fsdp2 train.cuda_graphs=true
             done ;;
    # issue 41: FSDP2 on one rank under CUDA graphs at the default config: their GPU tests (no host sync before the
    # step's line, graphs change no bit at tiers 3 and 4); fgrid: FSDP2 tier 3 beside flat tier 3 (FG_MODELS,
    # FG_MICRO, ROUNDS, FG_T: the grid's seconds; no plain loop)
    fgraphs) stage fgtests 420 python3 -m pytest tests/test_cuda_graphs_gpu.py -q -p no:cacheprovider -rfE \
               tests/test_engines.py::test_fsdp2_compiled_reruns_identical_on_gpu ;;
    fgrid) stage fgrid ${FG_T:-300} python3 bench/bench_grid.py --models ${FG_MODELS:-125m} --micro ${FG_MICRO:-8} \
             --variants t3 f3 --rounds ${ROUNDS:-1} --steps 10 --no-plain \
             --out "$OUT/grid_fsdp2_$(echo ${FG_MODELS:-125m}_${FG_MICRO:-8} | tr ' ' _).md" ;;
    # issue 41: FSDP2 on one rank as one FSDP2 unit (DETTRAIN_FSDP2_UNITS=root: its hooks once a micro-batch, not once
    # a block; written after the device time of 2026-12-06 was spent): the GPU tests of FSDP2 under CUDA graphs with
    # it, then flat tier 3, FSDP2 per block and as one unit (tokens/s and peaks; FU_MODELS, FU_MICRO, ROUNDS)
    funits) stage futests 300 env DETTRAIN_FSDP2_UNITS=root python3 -m pytest tests/test_cuda_graphs_gpu.py -k fsdp2 \
              -q -p no:cacheprovider -rfE
            stage fugrid ${FU_T:-420} python3 bench/bench_grid.py --models ${FU_MODELS:-125m} --micro ${FU_MICRO:-4 8} \
              --variants t3 f3 f3r --rounds ${ROUNDS:-1} --steps 10 --no-plain \
              --out "$OUT/grid_funits_$(echo ${FU_MODELS:-125m}_${FU_MICRO:-4 8} | tr ' ' _).md" ;;
    # issue 41: FSDP2 units of several blocks on one rank (DETTRAIN_FSDP2_UNITS, default auto: 125m and the tests'
    # models the root's one unit, 1b and 7B one block a unit): the GPU tests of FSDP2 under CUDA graphs with
    # two blocks a unit (fully_shard of a list; the tests' 2-block model) and of its offload at the default, then
    # flat tier 3 beside FSDP2 at auto, per block and as one unit (FA_MODELS, FA_MICRO, ROUNDS)
    fauto) stage fatests 300 env DETTRAIN_FSDP2_UNITS=2 python3 -m pytest tests/test_cuda_graphs_gpu.py -k fsdp2 \
             -q -p no:cacheprovider -rfE
           stage faotests 200 python3 -m pytest tests/test_offload_gpu.py -k fsdp2 -q -p no:cacheprovider -rfE
           stage fagrid ${FA_T:-300} python3 bench/bench_grid.py --models ${FA_MODELS:-125m hf125m} \
             --micro ${FA_MICRO:-4} --variants t3 f3 f3b f3r --rounds ${ROUNDS:-1} --steps 10 --no-plain \
             --out "$OUT/grid_fauto_$(echo ${FA_MODELS:-125m hf125m}_${FA_MICRO:-4} | tr ' ' _).md" ;;
    # issue 41: where tier 3's 28 ms and tier 4's 40 ms a step over tier 0 go at 1b micro-batch 1 (0.961x, 0.907x in
    # the grid of 2026-12-07): two profiled steps of the trainer each (bench/profile_steps.py, after 3 steps), tiers 0,
    # 3 and 4, then tier 0's trace against each (PR_MODEL, PR_GB, PR_MB)
    prof1b) for t in 0 3 4; do
              stage prof_t$t 200 python3 bench/profile_steps.py --trace "$OUT/prof_t$t.json" -- \
                model=${PR_MODEL:-1b} train.global_batch=${PR_GB:-16} train.micro_batch=${PR_MB:-1} det.tier=$t \
                train.steps=5 ckpt.final=false log.every=1
            done
            for t in 3 4; do
              stage prof_cmp$t 60 python3 bench/trace_summary.py "$OUT/prof_t0.json.gz" "$OUT/prof_t$t.json.gz" --top 25
            done ;;
    # issue 41: tier 3's gap at 1b micro-batch 1 is the attention backward (prof1b, 2026-12-07: dettrain's 0.277 ms a
    # call against cuDNN's 0.168, 38 ms a step; 4 kv heads x 32 key blocks = 128 dK/dV programs for 132 SMs, the
    # longest looping over 8 query heads x 32 query blocks). The dK/dV pass with each GQA group split over programs
    # (DETTRAIN_ATTN_KV_SPLIT, kernels/attention.py kv_split): its GPU tests, the backward alone at the 1b shapes of
    # micro-batches 1, 2, 4, 8 against cuDNN's (asplit, one call); then, in a call of its own, the CLI at tiers 0,
    # 3, 4 with and without a split of 4 (asgrid: AS_MICRO, AS_VARIANTS, AS_T; 10 runs of about 35 s by default)
    asplit) stage astests 240 python3 -m pytest tests/test_attention_bwd_gpu.py -k "split or launch_order" -q \
              -p no:cacheprovider -rfE
            stage ascmp 180 $B attn-cmp --shapes 1b1 1b2 1b 1b8 --rounds 3 --extra split:2 split:4 split:8 ;;
    asgrid) stage asgrid ${AS_T:-480} python3 bench/bench_grid.py --models 1b --micro ${AS_MICRO:-1 8} \
              --variants ${AS_VARIANTS:-t0 t3 t3k4 t4 t4k4} --rounds ${ROUNDS:-1} --steps 10 --no-plain \
              --out "$OUT/grid_asplit_$(echo ${AS_MICRO:-1 8} | tr ' ' _).md" ;;
    # issue 41: the whole grid at the defaults, plain loop included, over as many device calls as it takes: each
    # call starts runs for GRID_BUDGET seconds (default 440) and takes the runs of earlier calls from GRID_RESUME
    # (default .devtmp/grid.json: copy the $OUT/grid.json a call brought back there, and carry .devtmp); GRID_MODELS,
    # GRID_MICRO (micro-batch sizes, default each model's all), GRID_VARIANTS and ROUNDS narrow a call;
    # GRID_REMEASURE="t3 t4 f3" drops the resumed runs of those variants in the cells the call covers (after a code
    # change they measure), in the first call only: the next calls resume from the grid.json it brought back. Next:
    # the 1b cells with the attention backward's split default (2026-12-07 late), GRID_MODELS=1b GRID_REMEASURE="t3
    # t4 f3" in the first call, then GRID_MODELS=1b alone
    # With GRID_PACK=1, Inductor's and Triton's caches travel the same way ($OUT/compile_cache.tgz.0, .1, ... to .devtmp/; remove the
    # older parts first), so a later call does not compile again what an earlier one did; tokens/s exclude the
    # compiling step either way.
    # train.overlap_steps on the GPU: its tests, then pipelined steps (p; pf: with the parameter and optimizer
    # hashes on a side stream) against the default serial ones through the CLI at 1b
    ovtests) stage ovtests 300 python3 -m pytest tests/test_overlap_steps.py -k gpu -q -p no:cacheprovider -rfE ;;
    # DETTRAIN_FP_FUSED=1: the FSDP2 engine's AdamW hashes what it stores (its GPU tests), then through the CLI
    # beside FSDP2 hashing again (bench_grid's f3x against f3) at 1b micro-batches 2 and 8
    fftests) stage fftests 300 python3 -m pytest tests/test_fused_fp.py -k gpu -q -p no:cacheprovider -rfE ;;
    ffgrid) stage ffgrid 560 python3 bench/bench_grid.py --models ${GRID_MODELS:-1b} --micro ${GRID_MICRO:-2 8} \
              --variants t3 f3 f3x --rounds ${ROUNDS:-1} --steps 10 --timeout 120 --no-plain \
              --budget ${GRID_BUDGET:-400} --out "$OUT/ffgrid.md" ;;
    # the host's part of each step (bench/host_step.py: the line's read and each observer, the wandb mirror at its
    # default, offline) at 1b micro-batch 2, tier 0 serial: what train.overlap_steps can hide
    hoststep) stage hoststep 240 python3 bench/host_step.py --json "$OUT/hoststep.json" -- model=1b \
                train.global_batch=16 train.micro_batch=${HS_MICRO:-2} det.tier=${HS_TIER:-0} train.steps=12 \
                ckpt.final=false log.every=1 ;;
    # tier 0 on a GPU, two serial runs of the overlap test's tiny job: whether they part (and where), as the overlap
    # run did on 2026-12-07 (BENCHMARKS.md, "The 1b cells with the split, and train.overlap_steps on a GPU")
    # (T0_A, T0_B: each run's extra overrides; serial by default: train.overlap_steps=auto overlaps them on CUDA)
    t0rerun) export T0_A=${T0_A:-train.overlap_steps=false} T0_B=${T0_B:-train.overlap_steps=false}
             stage t0rerun 200 bash -c 'for r in A B; do eval "x=\$T0_$r"; python3 -m dettrain model.dim=64 \
               model.n_layers=2 model.n_heads=4 model.n_kv_heads=2 model.ffn_dim=128 model.seq_len=64 \
               data.max_bytes=300000 log.wandb.mode=disabled train.steps=5 det.tier=0 train.global_batch=16 \
               train.micro_batch=4 model.dropout=0.1 run_dir=/tmp/t0rerun_$r $x || exit 1; done
               python3 -m dettrain.diff /tmp/t0rerun_A /tmp/t0rerun_B' ;;
    # resumes from OV_RESUME (default .devtmp/ovgrid.json, an earlier call's $OUT/ovgrid.json copied there; else the
    # runs committed in bench/results/ovgrid.json); GRID_REMEASURE drops those variants' runs first (the t0 and t3
    # committed there were serial, the default before 2026-12-08); ROUNDS (default 1) rounds a cell
    ovgrid) R=${OV_RESUME:-.devtmp/ovgrid.json}; [ -f "$R" ] || R=bench/results/ovgrid.json
            stage ovgrid 560 python3 bench/bench_grid.py --models ${GRID_MODELS:-1b} --micro ${GRID_MICRO:-2 4 8} \
              --variants ${GRID_VARIANTS:-t0 t0s t3 t3s} --rounds ${ROUNDS:-1} --steps 10 --timeout 120 \
              $([ -n "${GRID_REMEASURE:-}" ] && [ -f "$R" ] && echo --remeasure $GRID_REMEASURE) \
              --budget ${GRID_BUDGET:-250} $([ -f "$R" ] && echo --resume "$R") --out "$OUT/ovgrid.md" ;;
    fullgrid) R=${GRID_RESUME:-.devtmp/grid.json}; C=${GRID_CACHE:-.devtmp/compile_cache.tgz}
              # no earlier call's runs in .devtmp/: the grid committed so far (BENCHMARKS.md's grid table)
              [ -f "$R" ] || R=bench/results/grid.json
              # Inductor's and Triton's caches travel as parts of at most 15 MiB (a file back from $OUT is at most
              # 16 MiB), three at most (45 MiB: the files back are 64 MiB together); C.0, C.1, ... (or C whole)
              CDIRS="${TMPDIR:-/tmp}/torchinductor_$(whoami) $HOME/.triton"
              if ls "$C".[0-9] >/dev/null 2>&1; then cat "$C".[0-9] | tar -C / -xz && echo "compile caches unpacked from $C.*"
              elif [ -f "$C" ]; then tar -C / -xzf "$C" && echo "compile caches unpacked from $C"; fi
              stage fullgrid 560 python3 bench/bench_grid.py --models ${GRID_MODELS:-125m hf125m 1b} \
                $([ -n "${GRID_MICRO:-}" ] && echo --micro $GRID_MICRO) \
                $([ -n "${GRID_REMEASURE:-}" ] && [ -f "$R" ] && echo --remeasure $GRID_REMEASURE) --variants ${GRID_VARIANTS:-t0 t3 t4 f3} --rounds ${ROUNDS:-2} --steps 10 --timeout 120 \
                --budget ${GRID_BUDGET:-440} $([ -f "$R" ] && echo --resume "$R") --out "$OUT/grid.md"
              HAVE=$(for d in $CDIRS; do [ -d "$d" ] && echo "${d#/}"; done)
              # GRID_PACK=1 brings the caches back (off by default: the 1b caches, 59 MB on 2026-12-07, did not fit,
              # and packing takes up to 40 s of the call)
              if [ -n "$HAVE" ] && [ "${GRID_PACK:-0}" = 1 ]; then
                timeout 40 tar -C / -czf /tmp/compile_cache.tgz $HAVE
                if [ "$(stat -c %s /tmp/compile_cache.tgz)" -gt 47185920 ]; then
                  echo "compile caches too large to bring back: $(du -h /tmp/compile_cache.tgz)"
                else
                  split -b 15M -d -a 1 /tmp/compile_cache.tgz "$OUT/compile_cache.tgz."
                  echo "compile caches packed: $(ls "$OUT"/compile_cache.tgz.* | wc -l) part(s) of $(du -h /tmp/compile_cache.tgz)"
                fi
                rm -f /tmp/compile_cache.tgz
              fi ;;
    *) echo "unknown stage $1" ;;
  esac
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
for s in "${@:-tests fp inv ops verify t125a t125 t1b l7b}"; do
  for x in $s; do run_stage "$x"; done
done
ls -la "$OUT"
