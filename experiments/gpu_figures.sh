#!/usr/bin/env bash
# The GPU figures docs/performance.md lists as not yet measured, in priority order,
# within a time budget: one log per figure in OUT_DIR.
#
#   experiments/gpu_figures.sh OUT_DIR SECONDS [NAME ...]
#
# NAME picks figures (default: all, in the order below). A figure starts only while
# at least 60 s of the budget are left, and is stopped when the budget runs out, so a
# lease of a few minutes brings back whole logs of what fitted; the names not run are
# printed at the end for a second call. Needs no TensorFlow: on a GPU machine without
# them, install the ml_collections and simplejpeg wheels first (docs/performance.md).
set -u
out="$1"; budget="$2"; shift 2
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(eval vs_torch packed_mnist packed_resnet50 race steps_loop decode backbones population)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
end=$(( $(date +%s) + budget ))

command_of() {
  case "$1" in
    eval) echo "python experiments/device_report.py --sections eval" ;;
    vs_torch) echo "python experiments/bench_vs_torch.py --device cuda --check --rounds 5" ;;
    packed_mnist) echo "python experiments/bench_packed_steps.py --model mnist --packs 1 8 32 128" ;;
    packed_resnet50) echo "python experiments/bench_packed_steps.py --model resnet50 --packs 1 2 4" ;;
    race) echo "python experiments/race_loop.py --device cuda --workers 16 --steps 150 --warmup 20 --rounds 2" ;;
    steps_loop) echo "python experiments/device_report.py --sections steps loop" ;;
    decode) echo "python experiments/bench_decode.py --images 10000" ;;
    backbones) echo "python experiments/bench_backbones.py --batch 96 --dtypes float32 bfloat16" ;;
    population) echo "python experiments/bench_population.py --model resnet50 --members 2 4 8 --steps 101" ;;
    *) echo "" ;;
  esac
}

left=()
for name in "${names[@]}"; do
  cmd="$(command_of "$name")"
  [ -z "$cmd" ] && { echo "unknown figure: $name"; exit 2; }
  remaining=$(( end - $(date +%s) ))
  if [ "$remaining" -lt 60 ]; then left+=("$name"); continue; fi
  echo "== $name: $cmd (at most $remaining s)"
  start=$(date +%s)
  timeout --signal=INT --kill-after=10 "$remaining" bash -c "$cmd" > "$out/$name.txt" 2>&1
  rc=$?
  echo "   rc=$rc in $(( $(date +%s) - start )) s"
  tail -n 3 "$out/$name.txt"
done
echo "not run (budget spent): ${left[*]:-none}"
