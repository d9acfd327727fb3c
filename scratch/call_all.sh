set -u
RUNS="base:200:MPSC_NO_GATED=1 gated:130:X=1 combo:130:MPSC_INDUCTOR=combo_kernels=1" bash scratch/call1.sh
PYTHONPATH=$PWD/src timeout 170 python scratch/pf_diag.py /tmp/w both > $OUT/pf_diag.log 2>&1; echo pf rc $?
grep -v "^    " $OUT/pf_diag.log | cut -c1-600 | tail -12
