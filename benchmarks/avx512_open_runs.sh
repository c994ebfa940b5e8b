#!/usr/bin/env bash
# The runs issue 22 still needs on the AVX512-BF16 CPU (BENCHMARKS.md: "The default job on each
# CPU", "Time to accuracy", "CIFAR-10 in 30 minutes"), one after another on a quiet machine:
#   bash benchmarks/avx512_open_runs.sh [OUT_DIR]      (~80 minutes)
# Needs the venv active and TFDS_DATA_DIR holding cifar10/3.0.2. Refuses on another CPU: on the
# AVX2-only one these numbers exist already.
set -euo pipefail
if ! grep -qw avx512_bf16 /proc/cpuinfo; then
  echo "this CPU has no avx512_bf16 (lscpu); these runs are for the AVX512-BF16 one" >&2
  exit 2
fi
out="${1:-runs/avx512-open-$(date +%Y%m%d-%H%M)}"
mkdir -p "$out"
{ date -u; lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-200; grep -m1 '^model' /proc/cpuinfo; uptime; } \
  > "$out/machine.txt"
run() { echo "+ $*" | tee -a "$out/commands.txt"; "$@" 2>&1 | grep -v '^[IWE]0000\|^WARNING: All log' | tee -a "$out/log.txt"; }
# Item 1: the shipped 3-epoch default job, wall time and peak RSS.
run /usr/bin/time -v tfdp-train --model_dir="$out/default_job"
# Item 4: time to 80% against plain model.fit with the same recipe, twice.
for n in 1 2; do
  run tfdp-bench --mode=tta --runs=tfdp,keras_recipe --targets=0.7,0.75,0.8 --output_dir="$out/tta/run$n"
done
# Item 4: the 30-minute config as shipped, then the candidate with one evaluation at the end,
# translate TTA and a twelfth epoch (BENCHMARKS.md: "The rest of airbench").
run /usr/bin/time -v tfdp-train --config_file=configs/cifar10_airbench.yaml --model_dir="$out/airbench"
run /usr/bin/time -v tfdp-train --config_file=configs/cifar10_airbench.yaml --model_dir="$out/airbench_12ep" \
  --params_override=trainer.epochs=12,trainer.eval_every_epochs=12,task.eval_translate=1
uptime >> "$out/machine.txt"
echo "results in $out"
