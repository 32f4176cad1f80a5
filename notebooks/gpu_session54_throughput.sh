#!/bin/bash
# Session 54: offline throughput of the 8B with fp8 weights and fp8 activations (W8A8) on an H200, run
# twice at 256 sequences. With CACHE=DIR the first run writes the compilation cache and program store
# there and the second is a restart on them; without it both compile. MORE=1 adds 512 sequences and
# 2,048 prompts (its new decode buckets compile; session 54 gave it ~240 s on a warm cache).
#   [CACHE=/tmp/cc] bash notebooks/gpu_session54_throughput.sh     # -> $OUT/tp_*.json, $OUT/tp_*.log
set -u
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B="python -m atlasjax.bench throughput --preset llama-3.1-8b --num-prompts 1024 --input-len 128 --output-len 128
   --max-num-batched-tokens 8192 --quantization fp8 --quantize-lm-head --activation-quantization fp8
   ${CACHE:+--compilation-cache $CACHE}"   # CACHE=DIR: the restart loads what the first run wrote
run() {   # tag, timeout, extra flags
    local t0=$(date +%s.%N)
    timeout $2 $B ${@:3} --output $OUT/tp_$1.json > $OUT/tp_$1.log 2>&1
    local rc=$?
    echo "== $1 rc=$rc wall $(python -c "print(round($(date +%s.%N) - $t0, 1))") s"
    grep -i "warm-up\|tok/s\|compiles\|loaded\|program" $OUT/tp_$1.log | grep -v "^W\|^I0" | tail -14
}
run first_256 ${T1:-380} --max-num-seqs 256
run restart_256 ${T2:-120} --max-num-seqs 256
[ "${MORE:-0}" = 1 ] && run seqs_512 ${T3:-300} --max-num-seqs 512 --num-prompts 2048
exit 0
