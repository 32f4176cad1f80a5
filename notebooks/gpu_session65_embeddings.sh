#!/bin/bash
# Session 65, embeddings: tests/test_embedding.py on the GPU (float32 engines against Hugging Face on the
# same weights; the Pallas ragged prefill attention runs the hidden states; the openai SDK the server tests
# need is not on the device image), then `bench embed` on random weights: Qwen3-Embedding-0.6B shapes
# (bf16) at 1 input of 128 tokens, 256 inputs of 256 tokens and 256 of 512 +- 50%, and Qwen3-8B shapes
# (Qwen3-Embedding-8B's) at 64 inputs of 512 tokens.
#   bash notebooks/gpu_session65_embeddings.sh     # on nvidia-h200 -> $OUT/embed_*.json
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_embedding.py 2>&1 | tail -4
for run in "qwen3-embedding-0.6b 1 128 0.0" "qwen3-embedding-0.6b 256 256 0.0" "qwen3-embedding-0.6b 256 512 0.5" "qwen3-8b 64 512 0.0"; do
    set -- $run
    name=embed_$1_$2x$3_r$4
    timeout 150 python3 -m atlasjax.bench embed --preset $1 --num-prompts $2 --input-len $3 --range-ratio $4 \
        --max-model-len 2048 --num-iters 5 --output $OUT/$name.json > $OUT/$name.log 2>&1
    echo "== $name rc=$?"; grep -E "inputs/s|tokens/s|pass \(|padded|programs|first pass|achieved FLOP|roofline floor" $OUT/$name.log
done
