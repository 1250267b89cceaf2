#!/usr/bin/env bash
# perf/run_bench.sh - run kvferry's standard benchmark sweep and write JSON
# files (one per step) into OUTDIR; render them with perf/report.py.
#
#   perf/run_bench.sh [--quick] [--bench PATH] [--steps LIST] [--report] OUTDIR
#
# Steps (all by default; --steps picks some, comma-separated):
#   curve      llama-3.1-8b fa nhd/hnd and deepseek-v3-mla-bf16: 256..32768 tokens,
#              d2h h2d d2d d2d-scatter p2p, SM caps default and 4 for d2h/h2d,
#              every baseline (the bandwidth-versus-size plot)
#   presets    every other preset: 256, 4096, 16384 tokens, d2h h2d d2d p2p
#   smcaps     the curve presets at 8192 tokens, caps 1 2 4 8 16 all, limit only
#   latency    one 256-token chunk of deepseek-v3-mla-bf16 (61 layers), per direction
#   interference  a cuBLAS bf16 GEMM (or an FMA kernel) on another stream while
#              d2h / h2d transfers run, at each SM cap
# p2p runs only where two GPUs are visible (else kvf_bench records it as skipped).
#
# Duration on one H200 (estimated with kvf_bench --plan, which prints the same
# figures without a GPU): about 5 minutes, --quick about 1 minute; p2p on a
# two-GPU machine adds about a minute. Each step runs under a time limit so a
# hang cannot eat the whole lease.
#
# Environment: KVF_BENCH (the kvf_bench binary), KVF_PRESET_DIR (presets),
# KVF_CUBLAS (path to libcublas.so.13 if it is not found), KVF_GIT_COMMIT,
# KVF_BENCH_EXTRA (extra kvf_bench arguments for every step).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
quick=0
report=0
steps="curve,presets,smcaps,latency,interference"
bench=${KVF_BENCH:-}
outdir=""

usage() { sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while (($#)); do
  case "$1" in
    --quick) quick=1 ;;
    --report) report=1 ;;
    --bench) bench=$2; shift ;;
    --steps) steps=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "run_bench.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) outdir=$1 ;;
  esac
  shift
done
[[ -n $outdir ]] || { usage >&2; exit 2; }

# The benchmark binary: --bench, $KVF_BENCH, the usual build trees, PATH.
if [[ -z $bench ]]; then
  for c in "$root"/build-perf/perf/kvf_bench "$root"/build*/perf/kvf_bench "$root"/build/*/perf/kvf_bench \
           "$here"/../../../bin/kvf_bench "$(command -v kvf_bench 2>/dev/null)"; do
    [[ -n $c && -x $c ]] && { bench=$c; break; }
  done
fi
if [[ -z $bench || ! -x $bench ]]; then
  echo "run_bench.sh: kvf_bench not found; build it (cmake -DKVF_BUILD_PERF=ON, target kvf_bench) and pass --bench PATH" >&2
  exit 2
fi
if [[ -z ${KVF_PRESET_DIR:-} && -d $root/geometry/presets ]]; then
  export KVF_PRESET_DIR=$root/geometry/presets
fi

# cuBLAS for the interference step, loaded by kvf_bench at run time.
if [[ -z ${KVF_CUBLAS:-} ]]; then
  for c in /usr/local/cuda/lib64/libcublas.so.13 /usr/local/cuda/targets/x86_64-linux/lib/libcublas.so.13 \
           $(ldconfig -p 2>/dev/null | awk '/libcublas\.so\.13 /{print $NF}'); do
    [[ -e $c ]] && { export KVF_CUBLAS=$c; break; }
  done
fi
if [[ -z ${KVF_CUBLAS:-} ]] && command -v python3 >/dev/null 2>&1; then
  c=$(python3 - <<'EOF' 2>/dev/null
import glob, os, site
dirs = site.getsitepackages() + [site.getusersitepackages()]
for d in dirs:
    for p in glob.glob(os.path.join(d, "nvidia", "**", "libcublas.so.13"), recursive=True):
        print(p); raise SystemExit
EOF
)
  [[ -n $c ]] && export KVF_CUBLAS=$c
fi
if [[ -n ${KVF_CUBLAS:-} ]]; then
  # libcublas.so.13 needs libcublasLt.so.13 from its own folder.
  export LD_LIBRARY_PATH="$(dirname "$KVF_CUBLAS")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [[ -z ${KVF_GIT_COMMIT:-} ]] && git -C "$root" rev-parse HEAD >/dev/null 2>&1; then
  KVF_GIT_COMMIT=$(git -C "$root" rev-parse --short=12 HEAD)
  [[ -n $(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null) ]] && KVF_GIT_COMMIT+="-dirty"
  export KVF_GIT_COMMIT
fi

mkdir -p "$outdir" || exit 2
log=$outdir/bench.log
curve=llama-3.1-8b-fa-nhd,llama-3.1-8b-fa-hnd,deepseek-v3-mla-bf16
others=$("$bench" --list | grep -v -x -e llama-3.1-8b-fa-nhd -e llama-3.1-8b-fa-hnd -e deepseek-v3-mla-bf16 | paste -sd, -)
extra=(${KVF_BENCH_EXTRA:-})

if ((quick)); then
  common=(--target-ms 20 --min-reps 3 --max-reps 100 --warmup 1 --max-memcpy-runs 2048 --max-batch-runs 16384)
  curve_tokens=256,4096
  curve_dirs=d2h,h2d,d2d,p2p
  preset_tokens=4096
  preset_list=llama-3.1-70b-tp4-rank2-slice,qwen3-next-like-hybrid
  smcaps_tokens=4096
  smcaps_presets=llama-3.1-8b-fa-nhd
  samples=3
else
  common=(--target-ms 40 --min-reps 5 --max-reps 200 --warmup 2 --max-memcpy-runs 8192 --max-batch-runs 32768)
  curve_tokens=256,1024,4096,16384,32768
  curve_dirs=d2h,h2d,d2d,d2d-scatter,p2p
  preset_tokens=256,4096,16384
  preset_list=$others
  smcaps_tokens=8192
  smcaps_presets=$curve
  samples=7
fi

failed=0
t_all=$SECONDS
# step NAME LIMIT_SECONDS ARGS...: one kvf_bench run writing OUTDIR/NAME.json
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc
  echo "== $name: $bench $* ${common[*]} ${extra[*]}" | tee -a "$log"
  timeout --signal=INT --kill-after=20 "$limit" "$bench" "$@" "${common[@]}" "${extra[@]}" \
    --out "$outdir/$name.json" --label "run_bench.sh $name$( ((quick)) && echo ' --quick')" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  ((rc == 0)) || failed=1
}

want() { [[ ",$steps," == *",$1,"* ]]; }

want curve && step curve 450 --preset "$curve" --tokens "$curve_tokens" --directions "$curve_dirs" \
  --sms-pcie 0,4 --sms-device 0 --baselines all
if want presets; then
  # One process per preset: a crash or a sticky CUDA error costs one preset only.
  IFS=, read -r -a plist <<<"$preset_list"
  for p in "${plist[@]}"; do
    step "preset-$p" 180 --preset "$p" --tokens "$preset_tokens" --directions d2h,h2d,d2d,p2p \
      --sms-pcie 0,4 --sms-device 0 --baselines all
  done
fi
want smcaps && step smcaps 220 --preset "$smcaps_presets" --tokens "$smcaps_tokens" --directions d2h,h2d,d2d \
  --sms 1,2,4,8,16,all,default --baselines limit
want latency && step latency 60 --mode latency --preset deepseek-v3-mla-bf16 --tokens 256 \
  --directions d2h,h2d,d2d,p2p
want interference && step interference 150 --mode interference --preset llama-3.1-8b-fa-nhd --tokens 4096 \
  --directions d2h,h2d --sms 1,2,4,8,16,all,default --samples "$samples"

echo "run_bench.sh: done in $((SECONDS - t_all)) s; JSON in $outdir$( ((failed)) && echo ' (some steps failed: see bench.log)')" | tee -a "$log"
if ((report)); then
  python3 "$here/report.py" "$outdir" || echo "run_bench.sh: report.py failed (render on the development machine instead)"
fi
exit $failed
