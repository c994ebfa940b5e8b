#!/usr/bin/env bash
# BENCHMARKS.md's first sections in one run (not every section: the text, masked-LM and
# recommender runs, cluster boxes, ablations, RSS and GPU runs each have their own command
# there): bash benchmarks/run_all.sh [OUT_DIR]
# Needs the venv active (tfdp-bench on PATH) and TFDS_DATA_DIR holding cifar10/3.0.2.
set -euo pipefail
out="${1:-runs/bench-$(date +%Y%m%d-%H%M)}"
mkdir -p "$out"
run() { echo "+ $*" | tee -a "$out/commands.txt"; "$@" 2>&1 | grep -v '^[IWE]0000\|^WARNING: All log' | tee -a "$out/log.txt"; }
common=(--steps=20 --warmup_steps=5 --repeats=3)
run tfdp-bench --mode=throughput --models=resnet20 --replicas=1,2,4 --global_batch_sizes=128 "${common[@]}" --output_dir="$out/throughput"
for option in trainer.steps_per_loop=1 runtime.mixed_precision=mixed_bfloat16 runtime.jit_compile=true task.train_data.deterministic=false; do
  run tfdp-bench --mode=throughput --models=resnet20 --replicas=1 --global_batch_sizes=128 "${common[@]}" --nobaseline \
    --params_override="$option" --output_dir="$out/option-${option##*.}"
done
run tfdp-bench --mode=scaling --models=resnet20 --workers=2 --per_replica_batch=64 "${common[@]}" --output_dir="$out/scaling"
run tfdp-bench --mode=allreduce --workers=2 --output_dir="$out/allreduce"
run tfdp-bench --mode=input --models=resnet20 --data=cifar10 --replicas=1,2 --global_batch_sizes=128 "${common[@]}" --output_dir="$out/input"
run python benchmarks/worker_death.py --repeats=3 --work_dir="$out/worker_death"
# Issue 11: all-reduce variants across 2 workers, time to accuracy, what each recipe piece adds, the 30-minute recipe.
for option in runtime.all_reduce_dtype=bfloat16 runtime.bytes_per_pack=262144,runtime.all_reduce_order=backward \
    runtime.bytes_per_pack=262144,runtime.all_reduce_order=variables; do
  run tfdp-bench --mode=scaling --models=resnet20 --workers=2 --per_replica_batch=64 "${common[@]}" \
    --params_override="$option" --output_dir="$out/scaling-${option//[=,.]/_}"
done
run tfdp-bench --mode=tta --targets=0.6,0.7,0.75,0.8 --output_dir="$out/tta"
run python benchmarks/eval_variants.py --config_file=configs/cifar10_quick.yaml --model_dir="$out/variants"
run python benchmarks/eval_variants.py --config_file=configs/cifar10_quick.yaml --model_dir="$out/variants-f32" \
    --params_override=runtime.mixed_precision=float32
run tfdp-train --config_file=configs/cifar10_airbench.yaml --model_dir="$out/cifar10_airbench"
echo "results in $out"
