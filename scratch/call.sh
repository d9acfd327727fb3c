set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/new /tmp/m && tar xzf scratch/new_src.tgz -C /tmp/new && tar xzf scratch/main_src.tgz -C /tmp/m
N=/tmp/new/src; M=/tmp/m/src
(PYTHONPATH=$N timeout 90 python scratch/gpu_check_attn.py scratch/old_attention.py; echo attn rc $?; PYTHONPATH=$N timeout 90 python scratch/gpu_check_gemv.py; echo gemv rc $?) > $OUT/checks.log 2>&1
grep -v Warning $OUT/checks.log | tail -16
A="--arch llama --layers 32 --device cuda --prompt 128 --tokens 256 --ttft 128 --repeats 2 --same-rounds 0 --no-host --work /tmp/w"
run() { # name src timeout args
  n=$1; p=$2; t=$3; shift 3
  PYTHONPATH=$p TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$n timeout $t python $(dirname $p)/benchmarks/generate.py $A "$@" --out $OUT/$n.json > $OUT/$n.log 2>&1; echo $n rc $?
  grep -v "^\s*load_\|FillFunctor\|Writing model\|^\s*[0-9.]* us .*x  void" $OUT/$n.log | cut -c1-240 | tail -${TAILN:-30}
}
run new $N ${T1:-230} --variants ours --profile
TAILN=4 run main $M ${T2:-120} --variants ours
TAILN=6 run bf16 $N ${T3:-130} --variants bf16
