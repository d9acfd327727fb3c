set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/new && tar xzf scratch/new_src.tgz -C /tmp/new
N=/tmp/new/src
run() { # name timeout args
  n=$1; t=$2; shift 2
  PYTHONPATH=$N TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$n timeout $t python /tmp/new/benchmarks/generate.py --device cuda --prompt 128 --tokens 256 --ttft 128 --repeats 2 --same-rounds 0 --no-host "$@" --out $OUT/$n.json > $OUT/$n.log 2>&1; echo $n rc $?
  grep -v "^\s*load_\|FillFunctor\|Writing model\|^\s*[0-9.]* us .*x  void" $OUT/$n.log | cut -c1-240 | tail -${TAILN:-40}
}
run llama ${T1:-300} --arch llama --layers 32 --work /tmp/w --variants ours,ours-hf --profile
run mixtral ${T2:-240} --arch mixtral --layers 4 --work /tmp/wm --variants ours,bf16 --profile
