cd /work/main
. .venv/bin/activate
export TFDS_DATA_DIR=/work/shared/tensorflow_datasets
date -u
rm -rf /tmp/exp/default_f32
/usr/bin/time -v tfdp-train --model_dir=/tmp/exp/default_f32 --params_override=runtime.mixed_precision=float32 > /tmp/exp/default_f32.log 2>&1
date -u
rm -rf /tmp/exp/muon_f32
/usr/bin/time -v timeout 2400 tfdp-train --config_file=configs/cifar10_airbench_muon.yaml --model_dir=/tmp/exp/muon_f32 --params_override=runtime.mixed_precision=float32 > /tmp/exp/muon_f32.log 2>&1
date -u
