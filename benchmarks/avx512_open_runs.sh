#!/usr/bin/env bash
# Issue 22's runs on an AVX512-BF16 CPU (BENCHMARKS.md: "The AVX512-BF16 CPU, Zen 5"), one after
# another on a quiet machine; run on Zen 5 (family 26) on 2026-12-04, its commands one by one on
# an Intel Xeon with AMX on 2026-12-05 ("A third CPU"), and on Zen 4 (family 25 model 17) on
# 2026-12-07 but for its last run ("The AVX512-BF16 CPU, Zen 4"):
#   bash benchmarks/avx512_open_runs.sh [OUT_DIR]      (~40 minutes on Zen 5; its commands' runs
#   added up to ~50 on the Xeon; 25 on Zen 4 without the last, which would take 34-43 more)
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
# Items 0, 3, 6: one device and 1/2/4 replicas against model.fit, and the default job's model.
for n in 1 2; do
  run tfdp-bench --mode=throughput --models=resnet20 --replicas=1,2,4 --global_batch_sizes=128 \
    --steps=10 --warmup_steps=3 --repeats=3 --output_dir="$out/throughput/run$n"
  run tfdp-bench --mode=throughput --config_file=configs/cifar10_quick.yaml --replicas=1,2,4 \
    --nobaseline --global_batch_sizes=1000 --steps=5 --warmup_steps=2 --repeats=2 \
    --output_dir="$out/throughput-quick/run$n"
done
# Item 4: the 30-minute config as shipped (16 epochs).
run /usr/bin/time -v tfdp-train --config_file=configs/cifar10_airbench.yaml --model_dir="$out/airbench"
uptime >> "$out/machine.txt"
echo "results in $out"
