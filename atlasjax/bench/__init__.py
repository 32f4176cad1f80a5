"""atlasjax.bench: `python -m atlasjax.bench latency|throughput|serve|kernels` (docs/benchmarks.md).

- presets.py:    published architectures with random weights, and building an engine from flags
- roofline.py:   bytes and FLOPs a step must move/compute; measured copy bandwidth and matmul rate
- latency.py:    one fixed batch, step by step (TTFT, TPOT)
- throughput.py: N requests at once through the engine (requests/s, tok/s)
- serve.py:      streaming load generator for any OpenAI-compatible server (TTFT, TPOT, ITL, E2EL)
- kernels.py:    ceilings, model-shaped matmuls, and the attention / quantized-matmul kernel benchmarks
- hf_compare.py: Hugging Face transformers on the same shapes (`--compare hf`), in a subprocess
- report.py:     statistics, environment block, tables and the JSON file
This package imports no jax at import time (the HF subprocess and `serve` rely on that).
"""
