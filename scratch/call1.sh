set -u
export PYTHONPATH=$PWD/scratch/combo:$PWD/src
G="python benchmarks/generate.py --arch llama --layers 32 --device cuda --prompt 128 --tokens 256 --ttft 128 --repeats 2 --same-rounds 0 --no-host --profile --work /tmp/w --variants ours"
nvidia-smi --query-gpu=name --format=csv,noheader
run() { # name, timeout, env...
  n=$1; t=$2; shift 2
  env "$@" TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$n timeout $t $G --out $OUT/gen_$n.json > $OUT/gen_$n.log 2>&1; echo $n rc $?
  grep -v "^\s*load_\|^\s*[0-9.]* us .*x  void\|FillFunctor" $OUT/gen_$n.log | cut -c1-200 | tail -24
  grep -l "def call(" -r /tmp/ind_$n --include=*.py > /tmp/ind_$n.list 2>/dev/null; tar czf $OUT/oc_$n.tgz -T /tmp/ind_$n.list 2>/dev/null
}
for spec in ${RUNS:-"base:300:MPSC_NO_GATED=1 gated:250:X=1"}; do IFS=: read n t e <<< "$spec"; run $n $t $e; done
