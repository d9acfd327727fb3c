set -u
export PYTHONPATH=$PWD/src
G="python benchmarks/generate.py --arch llama --layers 32 --device cuda --prompt 128 --tokens 256 --ttft 128 --repeats 2 --same-rounds 0 --no-host --profile --work /tmp/w"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 210 $G --variants ours --out $OUT/gen_ours.json > $OUT/gen_ours.log 2>&1; echo ours rc $?
grep -E "decode|kernels:|target" $OUT/gen_ours.log | cut -c1-220
timeout 190 $G --variants bf16 --out $OUT/gen_bf16.json > $OUT/gen_bf16.log 2>&1; echo bf16 rc $?
grep -E "decode|kernels:|target" $OUT/gen_bf16.log | cut -c1-220
