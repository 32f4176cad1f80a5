"""The start-up line that says which format each weight runs in, and how many bytes it takes."""
import logging

import jax
import jax.numpy as jnp

from atlasjax.bench.presets import PRESETS, load_preset
from atlasjax.weights_summary import describe, nbytes, summarize


def test_summary_counts_each_format_and_its_bytes():
    params = load_preset("tiny", jnp.float32, "gguf-q4_k_m").params   # 2 layers, untied head
    summary = summarize(params)
    # Q4_K: 7 projections in layer 0, q/k/o/gate/up in layer 1; Q6_K as int8: v and down of layer 1, the head
    assert {name: n for name, (n, _) in summary.items()} == {"int4 g32 offsets": 12, "int8 g32": 3, "float32": 6}
    leaves = jax.tree_util.tree_leaves(params)   # codes, scales and offsets of every weight, and the floats
    assert sum(b for _, b in summary.values()) == sum(nbytes(x) for x in leaves)
    line = describe(params)
    assert line.startswith("weights ") and "int8 g32" in line and "(3 tensors)" in line


def test_engine_logs_the_summary_at_start(caplog):
    from atlasjax.engine import LLMEngine
    from atlasjax.engine_config import EngineConfig
    with caplog.at_level(logging.INFO, logger="atlasjax.engine"):
        LLMEngine(EngineConfig(max_num_seqs=2, max_model_len=64), loaded=load_preset("tiny", jnp.float32, "int8"))
    lines = [r.getMessage() for r in caplog.records if "weights" in r.getMessage()]
    projections = 7 * PRESETS["tiny"].num_layers   # q, k, v, o, gate, up, down per layer
    assert lines and "int8 per channel" in lines[0] and f"({projections} tensors)" in lines[0]
