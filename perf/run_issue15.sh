#!/usr/bin/env bash
# perf/run_issue15.sh - one GPU session for issue 15 ("one chunk at the link's
# limit"): conformance of the new routes first, then the benchmark steps the
# issue's targets need, JSON and logs into OUTDIR, a short table last.
#
#   perf/run_issue15.sh [--explore|--full] [--steps LIST] [--bundle DIR] [OUTDIR]
#
# Binaries are prebuilt (nothing is built here): test_xfer and kvf_bench from
# BUNDLE/bin (a folder made by perf/make_issue15_bundle.sh, carried to the GPU
# machine: it holds bin/, lib/, presets/ and these scripts), else from the
# build tree (build/rel). OUTDIR defaults to $OUT (the device tool's folder)
# or ./issue15-out.
#
# Steps (--steps, comma-separated; default: all of the mode's):
#   conf      test_xfer: every case once (GPU conformance of every route, every
#             preset, format, direction, memory kind, misaligned, windows, SM caps,
#             graph capture; the deferred calls' concurrent case alone, in its own
#             process, since it can deadlock), then compute-sanitizer memcheck and
#             racecheck on the new routes' cases for three presets
#   chunk     every preset at one chunk (256 tokens; whole chunks) and 4096 tokens,
#             d2h h2d d2d, SM caps default and 4, every baseline and every peer; then
#             d2d on every preset against two tunings (d2d-ab: the deep spread's
#             window: up to 512 MiB, and shallow everywhere)
#   cross     crossover sweeps on llama nhd / hnd and the 61-layer MLA cache at one
#             chunk and 4096 tokens: pieces per staged batch, tables in kernel
#             parameters or uploaded, task sizes, the batch-API route on/off and
#             its run thresholds, one batch call or memcpys per piece; caps default and 4
#   large     16384 and 32768 tokens on the same three presets (they must stay at the
#             limit), caps default and 4, limit/batch/cub (peers at 16384)
#   h2dtune   (not in the defaults) the staged one-chunk rows near 95% under the staged
#             route's parameters, twice, the MLA latency under other batch ramps (twice)
#             and the MLA caches staged
#   idle      (not in the defaults) one-chunk latency after 100 ms idle, kvferry and memcpy
#   d2dtask   (not in the defaults) d2d every preset, 256 and 4096 tokens, tasks of 4 and 2 KiB
#             against the default, twice
#   hostbound (not in the defaults) the batch-route chunks with KVF_XFER_BATCH_HOST_BOUND on (the
#             staged route's cost measured, and fixed at 1125) and off, per call, back to back and
#             alone, twice
#   latency   one chunk alone, synchronized: MLA, llama nhd, llama hnd; every direction; deferred
#             calls and the doubling batch ramp (KVF_XFER_BATCH_LINK_GBPS=0) as variants
#   interf    a cuBLAS bf16 GEMM (or the FMA kernel) on another stream while one-chunk
#             and 4096-token d2h / h2d transfers run: kvferry at caps default, 4, 16,
#             the grid-stride kernel, every peer, and the copy engine's memcpy
#   served    kvf_served_bench through kvferryd on GPU 0 (llama nhd, 256 tokens at 1 and 8
#             in flight, 4096 at 1; the first STORE after a registration against later ones)
#   stageab   4096 and 16384 tokens, every preset, d2h/h2d: the staged route's batch sizes and
#             pieces against the previous default (and without the small edge batch)
#   params    perf/kvf_param_probe: a launch's host and GPU cost by parameter size; and
#             perf/kvf_hop_probe: what the staged route's hand-offs between streams cost
#   profile   Nsight Compute (ncu) on one-chunk d2d kernels of four presets (not in the defaults:
#             --steps profile)
#   summary   report.py's per-size tables of what was measured (stdout, and OUTDIR/results.md),
#             report_served.py's table, and a short table last
# If the plain conformance run fails on the warp-walk kernel (the default) but not on
# the grid-stride one, the benchmark steps run with KVF_XFER_KERNEL=1 and say so.
# --explore (default): shorter timing, fewer presets at 4096 tokens, conformance
# sanitizer subsets smaller; about 7-8 minutes on one H200 (run 6: 394 s with the plain conformance cut at 130 s). --full: about 12.
#
# Environment: KVF_CUBLAS (libcublas.so.13), COMPUTE_SANITIZER, KVF_BENCH_EXTRA
# (extra kvf_bench arguments for every bench step), ISSUE15_BUDGET (seconds the
# whole script may take, default 460: each step's time limit is cut to what is
# left, keeping 15 s for the summary, and a step with under 20 s left is skipped).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mode=explore
steps=""
bundle=""
outdir=""
while (($#)); do
  case "$1" in
    --explore) mode=explore ;;
    --full) mode=full ;;
    --steps) steps=$2; shift ;;
    --bundle) bundle=$2; shift ;;
    -h|--help) sed -n '2,56p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run_issue15.sh: unknown option $1" >&2; exit 2 ;;
    *) outdir=$1 ;;
  esac
  shift
done
[[ -z $steps ]] && steps="conf,params,chunk,cross,large,latency,interf,served,stageab,summary"
[[ -z $outdir ]] && outdir=${OUT:-./issue15-out}
mkdir -p "$outdir" || exit 2
# Everything is written under a work folder and packed after every step into
# OUTDIR/issue15-results.tar.gz (the device tool brings back at most 8 files):
# OUTDIR ends with that archive, issue15.log and results.md.
work=${ISSUE15_WORK:-$(mktemp -d /tmp/issue15-work.XXXXXX)}
mkdir -p "$work" || exit 2
pack() { tar czf "$outdir/issue15-results.tar.gz.tmp" -C "$work" . 2>/dev/null &&
         mv "$outdir/issue15-results.tar.gz.tmp" "$outdir/issue15-results.tar.gz"; }

# A bundle travels compressed (make_issue15_bundle.sh): unpack it in place.
unpack_bundle() { # DIR
  local z
  for z in "$1"/bin/*.xz "$1"/lib/*.xz; do
    [[ -e $z ]] || continue
    if command -v xz >/dev/null 2>&1; then xz -d -f "$z"
    else python3 -c 'import lzma, os, sys; z = sys.argv[1]; open(z[:-3], "wb").write(lzma.open(z).read()); os.remove(z)' "$z"
    fi || { echo "run_issue15.sh: cannot unpack $z" >&2; exit 2; }
  done
  chmod +x "$1"/bin/* 2>/dev/null
  return 0
}
unpack_bundle "${bundle:-$here}"

# Where things are: a bundle (bin/ lib/ presets/ next to this script, or
# --bundle), else the source tree and its build.
if [[ -z $bundle && -x $here/bin/kvf_bench ]]; then bundle=$here; fi
if [[ -n $bundle ]]; then
  bin=$bundle/bin
  presets=$bundle/presets
  report=$bundle/report.py
  report_served=$bundle/report_served.py
  export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [[ -f $bundle/COMMIT ]] && export KVF_GIT_COMMIT=$(cat "$bundle/COMMIT")
else
  root=$(cd "$here/.." && pwd)
  bin=""
  for d in "$root/build/rel" "$root/build-perf" "$root/build"; do
    if [[ -x $d/perf/kvf_bench ]]; then bin=$d/bin-issue15; mkdir -p "$bin"
      ln -sf "$d/perf/kvf_bench" "$bin/kvf_bench"; ln -sf "$d/tests/test_xfer" "$bin/test_xfer"
      ln -sf "$d/perf/kvf_served_bench" "$bin/kvf_served_bench"; ln -sf "$d/tools/kvferryd" "$bin/kvferryd"; break; fi
  done
  [[ -n $bin ]] || { echo "run_issue15.sh: no build with perf/kvf_bench found" >&2; exit 2; }
  presets=$root/geometry/presets
  report=$here/report.py
  report_served=$here/report_served.py
  export LD_LIBRARY_PATH="$root/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
bench=$bin/kvf_bench
tests=$bin/test_xfer
export KVF_PRESET_DIR=$presets KVF_TEST_PRESET_DIR=$presets
log=$outdir/issue15.log
: > "$log"
say() { echo "$*" | tee -a "$log"; }

# cuBLAS for the interference step (loaded by kvf_bench at run time).
if [[ -z ${KVF_CUBLAS:-} ]]; then
  for c in /usr/local/cuda/lib64/libcublas.so.13 /usr/local/cuda/targets/x86_64-linux/lib/libcublas.so.13 \
           $(ldconfig -p 2>/dev/null | awk '/libcublas\.so\.13 /{print $NF}'); do
    [[ -e $c ]] && { export KVF_CUBLAS=$c; break; }
  done
fi
if [[ -z ${KVF_CUBLAS:-} ]] && command -v python3 >/dev/null 2>&1; then
  c=$(python3 -c 'import glob,site,os
for d in site.getsitepackages():
    for p in glob.glob(os.path.join(d,"nvidia","**","libcublas.so.13"),recursive=True): print(p); raise SystemExit' 2>/dev/null)
  [[ -n $c ]] && export KVF_CUBLAS=$c
fi
[[ -n ${KVF_CUBLAS:-} ]] && export LD_LIBRARY_PATH="$(dirname "$KVF_CUBLAS"):$LD_LIBRARY_PATH"

SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer 2>/dev/null || true)}
[[ -z $SAN && -x /usr/local/cuda/bin/compute-sanitizer ]] && SAN=/usr/local/cuda/bin/compute-sanitizer

{
  echo "mode $mode, steps $steps, out $outdir"
  echo "bench $bench; tests $tests; presets $presets"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>&1
  ldd "$bench" "$tests" 2>&1 | grep -i "not found"
  [[ -n $SAN ]] && "$SAN" --version 2>&1 | tail -n 1
} | tee -a "$log"

want() { [[ ",$steps," == *",$1,"* ]]; }
t_all=$SECONDS
failed=0
budget=${ISSUE15_BUDGET:-460}
# limit_for SECONDS: the step's limit cut to the budget left (0: skip it).
limit_for() {
  local left=$((budget - (SECONDS - t_all) - 15))
  if ((left < 20)); then echo 0; elif (($1 < left)); then echo "$1"; else echo "$left"; fi
}

# ---- conformance -----------------------------------------------------------------
# gtest filters: the new routes' cases for three presets (every format,
# direction and memory kind), the default-route, graph and failure-contract
# cases; racecheck only the kernels' cases (no host-only suites).
san_presets="llama_3_1_8b_fa_hnd*:*deepseek_v3_mla_fp8_656*:*glm_like_hybrid*"
if [[ $mode == explore ]]; then
  san_routes="*XferGpuRoutes*llama_3_1_8b_fa_hnd_canonical*:*XferGpuRoutes*glm_like_hybrid_native*"
  san_routes+=":*XferGpuRoutes*deepseek_v3_mla_fp8_656_native*:*XferGpuMisaligned*fp8_inline*"
else
  san_routes="*XferGpuRoutes*llama_3_1_8b_fa_hnd*:*XferGpuRoutes*deepseek_v3_mla_fp8_656*:*XferGpuRoutes*glm_like_hybrid*"
fi
san_filter="$san_routes:*XferGpu.DefaultRoutesForOneChunk*:*XferGpu.Overlapped*:*XferGpu.*Graph*:*XferGpu.StagedCallRefused*:*XferGpu.MaxSmsCapsTheLaunch*"
san_filter+=":*XferGpu.Deferred*:*XferGpu.CallDoesNotSynchronize*"
conf_run() { # NAME LIMIT FILTER [sanitizer...]
  local name=$1 limit filter=$3 rc t0=$SECONDS
  limit=$(limit_for "$2")
  shift 3
  if ((limit == 0)); then say "conf $name: skipped (time budget spent)"; failed=1; return; fi
  # 1 MiB staging buffers: requests of several chunks take several batches
  # (and the failure-contract case needs them; contexts read it at creation).
  # Every test named as it starts (no --gtest_brief): a run the limit kills
  # says which test it was in.
  KVF_XFER_STAGING_MB=1 timeout -k 10 "$limit" "$@" "$tests" --gtest_filter="$filter" \
    --gtest_output="xml:$work/conf-$name.xml" > "$work/conf-$name.log" 2>&1
  rc=$?
  local summary
  summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]' "$work/conf-$name.log" | tr '\n' ' ')
  if ((rc == 124 || rc == 137)); then
    summary+="killed (rc $rc: $( ((rc == 124)) && echo the limit || echo 'the limit or the OOM killer')) in $(grep '^\[ RUN' "$work/conf-$name.log" | tail -n 1 | sed 's/.*\] //') after $(grep -c '^\[       OK' "$work/conf-$name.log") passed"
  fi
  case $name in
    memcheck) summary+=" $(grep -o 'ERROR SUMMARY: [0-9]* errors\{0,1\}' "$work/conf-$name.log" | tail -n 1)" ;;
    racecheck) summary+=" $(grep -o 'RACECHECK SUMMARY: .*' "$work/conf-$name.log" | tail -n 1)" ;;
  esac
  say "conf $name: rc=$rc after $((SECONDS - t0)) s: $summary"
  if ((rc != 0)); then
    failed=1
    grep -E '^\[  FAILED  \] .*\.|Failure|Expected|Which is|=+ (Invalid|Race|ERROR|Error)' "$work/conf-$name.log" | head -n 25 | tee -a "$log"
  fi
  pack
}
if want conf; then
  # explore: the GPU cases (the CPU ones run in CI without a GPU); full:
  # everything but the cases that check the tunables' defaults, which the
  # 1 MiB staging of conf_run changes (2026-12-04: XferTuning failed there,
  # and the fallback below then benchmarked the grid-stride walk).
  # The deferred calls' concurrent case also runs alone, in its own process,
  # with one hardware queue for every stream (CUDA_DEVICE_MAX_CONNECTIONS=1):
  # the transparent mode it replaced (KVF_XFER_DEFER, removed 2026-12-05)
  # hung there at once, and a hung process cannot run the cases after it.
  deferred_case=XferGpu.ConcurrentCallsFromThreadsOnOneContext
  conf_run plain $([[ $mode == explore ]] && echo 260 || echo 300) \
    "$([[ $mode == explore ]] && echo '*XferGpu*:*XferStage*' || echo '*')-XferTuning.*:$deferred_case"
  CUDA_DEVICE_MAX_CONNECTIONS=1 conf_run deferred 30 "$deferred_case"
  # The warp walk (KVF_XFER_KERNEL=2) is the default kernel: if its cases fail
  # and the grid-stride walk's do not, benchmark the grid-stride walk rather
  # than a kernel known to be wrong (every contender is still checked). Only
  # the byte-for-byte suites of the routes count: a failing case elsewhere
  # (an error message, a graph's bookkeeping) says nothing about the kernel,
  # and falling back for one slows every benchmark row.
  # (Set after the sanitizer runs below, which check the default kernel.)
  fallback=0
  fails=$(grep -E '^\[  FAILED  \] .*\.' "$work/conf-plain.log" | sed 's/ ([0-9]* ms)$//' |
          grep -E 'XferGpu(Routes|Conformance|Misaligned|Window)\.' | sort -u)
  if [[ -n $fails ]]; then
    walk_fails=$(grep -vc 'grid_stride_walk' <<< "$fails")
    stride_fails=$(grep -c 'grid_stride_walk' <<< "$fails")
    if ((walk_fails > 0 && stride_fails == 0)); then
      fallback=1
      say "conf: FALLBACK: $walk_fails failing cases, none of the grid-stride walk's: benchmark steps run with KVF_XFER_KERNEL=1"
    fi
  fi
  if [[ -n $SAN ]]; then
    conf_run memcheck $([[ $mode == explore ]] && echo 70 || echo 150) "$san_filter" \
      "$SAN" --tool memcheck --error-exitcode 1 --print-limit 30
    conf_run racecheck $([[ $mode == explore ]] && echo 45 || echo 100) \
      "*XferGpuRoutes*llama_3_1_8b_fa_hnd*pinned*:*XferGpuRoutes*llama_3_1_8b_fa_hnd_canonical*spread*:*XferGpu.DefaultRoutesForOneChunk*:*XferGpu.Overlapped*" \
      "$SAN" --tool racecheck --error-exitcode 1 --print-limit 30
  else
    say "conf: compute-sanitizer not found: memcheck and racecheck not run"
    failed=1
  fi
  if ((fallback)); then export KVF_XFER_KERNEL=1; fi
fi

# ---- benchmark --------------------------------------------------------------------
extra=(${KVF_BENCH_EXTRA:-})
if [[ $mode == explore ]]; then
  common=(--target-ms 12 --min-reps 3 --max-reps 60 --warmup 1 --max-memcpy-runs 1024 --max-batch-runs 16384
          --enqueue-reps 9)
  served_reqs=(64 5 16 3)
  chunk_big=llama-3.1-8b-fa-nhd,llama-3.1-8b-fa-hnd,deepseek-v3-mla-bf16
  cross_tokens=256
  large_tokens=16384
  large_peers=none
  samples=3
else
  common=(--target-ms 30 --min-reps 5 --max-reps 150 --warmup 2 --max-memcpy-runs 4096 --max-batch-runs 32768
          --enqueue-reps 15)
  served_reqs=(64 5 16 5)
  chunk_big=""
  cross_tokens=256,4096
  large_tokens=16384,32768
  large_peers=all
  samples=5
fi
curve=llama-3.1-8b-fa-nhd,llama-3.1-8b-fa-hnd,deepseek-v3-mla-bf16
all=$("$bench" --list | paste -sd, -)
# A step's own options come after the mode's (kvf_bench takes an option's
# last value), so a step may ask for more reps or a smaller cap than the mode;
# KVF_BENCH_EXTRA comes last of all.
step() { # NAME LIMIT ARGS...
  local name=$1 limit t0=$SECONDS rc
  limit=$(limit_for "$2")
  shift 2
  if ((limit == 0)); then say "== $name: skipped (time budget spent)"; failed=1; return; fi
  say "== $name: kvf_bench ${common[*]} $* ${extra[*]}"
  timeout --signal=INT --kill-after=15 "$limit" "$bench" "${common[@]}" "$@" "${extra[@]}" \
    --out "$work/$name.json" --label "run_issue15.sh $mode $name" > "$work/$name.log" 2>&1
  rc=$?
  grep -E '^kvf_bench|ERROR|FAIL|differ|kvf_bench: ' "$work/$name.log" | head -n 12 | tee -a "$log"
  say "== $name: exit $rc after $((SECONDS - t0)) s"
  ((rc == 0)) || failed=1
  pack
}

if want params; then
  # What a kernel's parameter size costs, host and GPU (the launch blob's sizes).
  limit=$(limit_for 30)
  if ((limit == 0)); then say "== params: skipped (time budget spent)"
  elif [[ -x $bin/kvf_param_probe ]]; then
    timeout -k 5 "$limit" "$bin/kvf_param_probe" --json "$work/params.jsonl" > "$work/params.log" 2>&1
    say "== params: exit $?"
  else
    say "== params: kvf_param_probe missing"
  fi
  if [[ -x $bin/kvf_hop_probe ]]; then
    for a in "8699904 64" "8699904 4" "33554432 16"; do
      timeout -k 5 30 "$bin/kvf_hop_probe" $a 200
    done > "$work/hops.log" 2>&1
    say "== hops: exit $?"
  fi
  pack
fi

if want chunk; then
  # One chunk on every preset (with every peer); 4096 tokens on all (full) or a few (explore).
  # defer=1: the same calls deferred (kvf_xfer_gather_deferred, joined
  # after each), for their enqueue (the post alone) and GPU time.
  step chunk-256 $([[ $mode == explore ]] && echo 120 || echo 190) --preset "$all" --tokens 256 \
    --directions d2h,h2d,d2d --sms-pcie 0,4 --sms-device 0 --baselines all --peers all --tune defer=1
  # At least 5 reps: a 4096-token call takes about 10 ms, so the mode's 12 ms
  # target gave 3, and one slow rep of 3 moved a d2h row from 99.4% to 97.7%
  # of memcpy (perf/results/2026-12-05-h200-window-check).
  step chunk-4096 $([[ $mode == explore ]] && echo 60 || echo 120) --preset "${chunk_big:-$all}" --tokens 4096 \
    --directions d2h,h2d,d2d --sms-pcie 0,4 --sms-device 0 --baselines all --peers all --min-reps 5
  # Device to device on every preset at one chunk and 4096 tokens, against
  # the deep spread's window as an H100 would have it (up to 512 MiB) and
  # the shallow spread everywhere: the 12 MiB bound rests on one H200 run
  # (perf/results/2026-12-05-h200-deep-window).
  step d2d-ab $([[ $mode == explore ]] && echo 60 || echo 100) --preset "$all" --tokens 256,4096 \
    --directions d2d --sms-device 0 --baselines limit --peers none \
    --tune spread_deep_max_mb=512 --tune spread_deep_kb=0
fi

if want d2dtask; then
  # Not in the default steps: device to device on every preset at one chunk
  # and 4096 tokens with smaller tasks (KVF_XFER_TASK_BYTES 4096 and 2048
  # against 8192), twice to see the noise: whether a shorter last round of
  # a large spread launch gives back its calls' time over a back-to-back run's.
  for rep in 1 2; do
    step d2dtask-$rep 60 --preset "$all" --tokens 256,4096 --directions d2d --sms-device 0 --baselines limit \
      --peers none --tune task_bytes=4096 --tune task_bytes=2048
  done
fi

if want h2dtune; then
  # Not in the default steps: the staged one-chunk rows nearest the 95% line
  # (glm-like, HND, the tp4 slice) under the staged route's parameters, twice
  # to see the noise; then the MLA chunk's latency under other batch ramps
  # and the staged route. Run it without the summary step (its records
  # would count as rows of the targets).
  for rep in 1 2; do
    step h2dtune-$rep 90 --preset glm-like-hybrid,llama-3.1-8b-fa-hnd,llama-3.1-8b-flashinfer-hnd,llama-3.1-70b-tp4-rank2-slice \
      --tokens 256 --directions h2d,d2h --sms-pcie 0,4 --baselines limit --peers none --no-sustained \
      --tune small_stage_growth=2 --tune small_stage_growth=8 --tune small_stage_mb=0 --tune straight_kb=0 \
      --tune straight_kb=2048 --tune straight_kb=4096 --tune pieces=2 --tune pieces=3 --tune pieces=6 --tune stage_sms=32 \
      --tune growth=4 --tune small_stage_mb=0,cap=4 --tune straight_kb=4096,cap=4 --tune small_stage_growth=2,cap=4
  done
  for rep in 1 2; do
    step latency-ramp-$rep 40 --mode latency --preset deepseek-v3-mla-bf16 --tokens 256 --directions d2h,h2d \
      --latency-reps 200 --tune batch_link_gbps=0 --tune batch_first_runs=6 --tune batch_first_runs=16 \
      --tune batch_max_runs=0
  done
  # The MLA caches' one chunk staged instead of through the batch API.
  step mla-staged 40 --preset deepseek-v3-mla-bf16,deepseek-v3-mla-fp8-656,deepseek-v3-mla-dcp4-rank1 --tokens 256 \
    --directions h2d,d2h --sms-pcie 0 --baselines limit,batch --peers none --tune batch_max_runs=0
fi

if want idle; then
  # Not in the defaults: one chunk with the GPU and host left idle 100 ms
  # before each call (clocks down, threads asleep), kvferry and memcpy alike:
  # what a request after a pause pays that is not kvferry's own setup (the
  # served step's first STORE against a STORE after idleness).
  step latency-idle 90 --mode latency --preset llama-3.1-8b-fa-nhd,deepseek-v3-mla-bf16 --tokens 256 \
    --directions d2h,h2d,d2d --latency-reps 20 --idle-ms 100
fi

if want profile; then
  # Nsight Compute on one-chunk device-to-device kernels (one launch each,
  # after the check and a warm-up): where the time goes without hardware
  # counters being guessed at. Diagnostic only; not part of the explore set.
  ncu_bin=$(command -v ncu 2>/dev/null || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  if [[ -z $ncu_bin ]]; then say "== profile: ncu not found"
  else
    t0=$SECONDS
    for p in llama-3.1-8b-fa-nhd deepseek-v3-mla-bf16 deepseek-v3-mla-dcp4-rank1 llama-3.1-70b-tp4-rank2-slice; do
      limit=$(limit_for 40)
      ((limit == 0)) && break
      timeout -k 5 "$limit" "$ncu_bin" --clock-control none --kernel-name regex:kvf_walk --launch-skip 3 \
        --launch-count 1 --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
        "$bench" --preset "$p" --tokens 256 --directions d2d --sms-device 0 --baselines none --peers none \
        --no-sustained --enqueue-reps 0 --min-reps 3 --max-reps 3 --warmup 1 --target-ms 1 \
        --out "$work/profile-$p.json" > "$work/profile-$p.log" 2>&1
      say "== profile $p: exit $? ($(grep -m1 -o 'Duration.*' "$work/profile-$p.log" | tr -s ' '))"
    done
    say "== profile: $((SECONDS - t0)) s"
  fi
  pack
fi

if want hostbound; then
  # Not in the default steps: the batch-route chunks (three MLA caches, the
  # qwen3-like hybrid) with KVF_XFER_BATCH_HOST_BOUND on (the default: the
  # staged route's cost measured), on with the cost fixed at an eighth (the
  # rule before it measured) and off, one chunk d2h/h2d against memcpy and
  # cudaMemcpyBatchAsync, twice (the host's speed is bimodal on the lent
  # H200); then each call alone.
  for rep in 1 2; do
    step hostbound-$rep 90 --preset deepseek-v3-mla-bf16,deepseek-v3-mla-fp8-656,deepseek-v3-mla-dcp4-rank1,qwen3-next-like-hybrid \
      --tokens 256 --directions d2h,h2d --sms-pcie 0,4 --baselines limit,batch --peers none \
      --tune batch_staged_cost=1125 --tune batch_host_bound=0
    step hostbound-latency-$rep 50 --mode latency --preset deepseek-v3-mla-bf16,deepseek-v3-mla-fp8-656,deepseek-v3-mla-dcp4-rank1 \
      --tokens 256 --directions d2h,h2d --latency-reps 60 --tune batch_staged_cost=1125 --tune batch_host_bound=0
  done
fi

if want latency; then
  step latency 40 --mode latency --preset deepseek-v3-mla-bf16,llama-3.1-8b-fa-nhd,llama-3.1-8b-fa-hnd --tokens 256 \
    --directions d2h,h2d,d2d --latency-reps $([[ $mode == explore ]] && echo 60 || echo 200) \
    --tune defer=1 --tune batch_link_gbps=0
fi

if want interf; then
  step interference-256 $([[ $mode == explore ]] && echo 60 || echo 110) --mode interference \
    --preset llama-3.1-8b-fa-nhd,llama-3.1-8b-fa-hnd --tokens 256 --directions d2h,h2d --sms 0,4,16 \
    --samples "$samples" --peers all \
    --tune kernel=1 --tune kernel=1,cap=4
  [[ $mode == full ]] && step interference-4096 100 --mode interference --preset llama-3.1-8b-fa-nhd --tokens 4096 \
    --directions d2h,h2d --sms 0,4 --samples "$samples" --peers all
fi

if want served; then
  # kvferryd on GPU 0 and this bench as its engine: STORE/RETRIEVE of one
  # 256-token chunk at 1 and 8 in flight, 4096 tokens at 1, against the
  # in-process kernel and a memcpy in the same run; the first STORE after
  # the registration against later ones.
  t0=$SECONDS
  limit=$(limit_for 70)
  if ((limit == 0)); then say "== served: skipped (time budget spent)"; failed=1
  elif [[ ! -x $bin/kvf_served_bench || ! -x $bin/kvferryd ]]; then say "== served: kvf_served_bench or kvferryd missing"; failed=1
  else
    say "== served: kvf_served_bench llama-3.1-8b-fa-nhd, 256 tokens (1, 8 in flight) and 4096 (1)"
    half=$((limit / 2))
    KVF_KVFERRYD=$bin/kvferryd timeout -k 5 "$half" "$bin/kvf_served_bench" --geometry "$presets/llama-3.1-8b-fa-nhd.json" \
      --device 0 --tokens-per-request 256 --inflight 1,8 --requests "${served_reqs[0]}" --rounds "${served_reqs[1]}" \
      --json "$work/served-256.jsonl" > "$work/served.log" 2>&1
    rc1=$?
    KVF_KVFERRYD=$bin/kvferryd timeout -k 5 "$half" "$bin/kvf_served_bench" --geometry "$presets/llama-3.1-8b-fa-nhd.json" \
      --device 0 --tokens-per-request 4096 --inflight 1 --requests "${served_reqs[2]}" --rounds "${served_reqs[3]}" \
      --json "$work/served-4096.jsonl" >> "$work/served.log" 2>&1
    rc2=$?
    cat "$work"/served-256.jsonl "$work"/served-4096.jsonl > "$work/served.jsonl" 2>/dev/null
    grep -E '^served' "$work/served.log" | tee -a "$log"
    say "== served: exit $rc1/$rc2 after $((SECONDS - t0)) s"
    ((rc1 == 0 && rc2 == 0)) || failed=1
  fi
  pack
fi

# Crossovers and the largest requests last: the targets' own steps come first
# when the budget is short.
if want cross; then
  # Every variant against the default on the same configuration (the default
  # is the kvferry[default] entry itself). The staged variants turn the batch
  # route off so they measure the staged route even where the batch API wins.
  # A/B of the kernel (the grid-stride walk, kernel=1), the staged pieces and
  # their growth (the copy engine's start), SM caps, task sizes, the batch
  # route's run limit, tables uploaded; cap=N is the context's SM cap.
  tunes=(
    --tune kernel=1 --tune kernel=1,cap=4
    --tune pieces=1 --tune pieces=2 --tune pieces=3 --tune pieces=6 --tune pieces=8
    --tune pieces=2,growth=8 --tune pieces=3,growth=4 --tune pieces=3,growth=8 --tune pieces=4,growth=4
    --tune pieces=4,cap=4 --tune pieces=6,cap=4 --tune pieces=4,growth=3,cap=4 --tune pieces=8,cap=4
    --tune stage_sms=8 --tune stage_sms=32
    --tune task_waves=0 --tune task_waves=2 --tune task_waves=8
    --tune batch_max_runs=0 --tune batch_max_runs=1000000 --tune param_bytes=0
  )
  step cross $([[ $mode == explore ]] && echo 60 || echo 160) --preset "$curve" --tokens "$cross_tokens" \
    --directions d2h,h2d,d2d --sms-pcie 0 --sms-device 0 --baselines limit,batch --peers none "${tunes[@]}"
fi

if want large; then
  step large $([[ $mode == explore ]] && echo 60 || echo 120) --preset "$curve" --tokens "$large_tokens" \
    --directions d2h,h2d,d2d --sms-pcie 0,4 --sms-device 0 --baselines limit,batch,cub --peers "$large_peers" \
    --peers-max-tokens 16384 --max-batch-runs 16384
fi

if want stageab; then
  # Requests of many staging batches: the batch sizes and pieces of the
  # default (64 MiB batches, a 16 MiB first/last batch, 2 pieces a batch)
  # against the previous default (16 MiB batches, 4 pieces), every preset.
  step stage-ab $([[ $mode == explore ]] && echo 120 || echo 200) --preset "$all" --tokens 4096,16384 \
    --directions d2h,h2d --sms-pcie 0 --baselines limit --peers none --no-sustained \
    --tune staging_mb=16,edge_mb=0,multi_pieces=0 --tune edge_mb=0
fi

say "run_issue15.sh: benchmark and conformance done in $((SECONDS - t_all)) s$( ((failed)) && echo ' (some steps failed: see issue15.log)')"
if want summary; then
  if command -v python3 >/dev/null 2>&1; then
    python3 "$report" --brief "$work" > "$work/brief.txt" 2>&1
    cat "$work/brief.txt" >> "$log"
    cp "$work/results.md" "$outdir/results.md" 2>/dev/null
    if [[ -s $work/served.jsonl ]]; then python3 "$report_served" "$work" "$work/served.jsonl" >> "$log" 2>&1; fi
    # The short table, last: what the reply's tail must hold.
    {
      echo "== short table (full: issue15.log, results.md, served.md in the archive)"
      grep -E '^(conf |== .*: exit|conf: FALLBACK)' "$log"
      grep -E '^ +(settings|met|missed|MISSED|not measured|partly met)  ' "$work/brief.txt"
      grep -E '^ +(missed|behind|MISSED): ' "$work/brief.txt" | head -n 40
      [[ -s $work/served.md ]] && grep -E '^\| (0|-1) \|' "$work/served.md"
      echo "KVF_XFER_KERNEL=${KVF_XFER_KERNEL:-2 (default)}; bundle commit ${KVF_GIT_COMMIT:-?}; $((SECONDS - t_all)) s"
    } | tee -a "$log"
  else
    say "summary: python3 not found"
  fi
fi
cp "$log" "$work/" 2>/dev/null
pack
exit $failed
