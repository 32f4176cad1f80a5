"""Quantize once: save the quantized param tree with orbax and load it back directly."""
import time

from atlasjax import LLM, SamplingParams


def test_saved_quantized_model_loads_back_faster_with_the_same_output(default_model_path, tmp_path):
    t0 = time.perf_counter()
    llm = LLM(default_model_path, quantization="int8", max_num_seqs=2, max_model_len=256)
    convert_s = time.perf_counter() - t0
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=16)
    ref = llm.chat(msgs, params)[0].outputs[0]
    llm.save(str(tmp_path / "saved"))
    t0 = time.perf_counter()
    again = LLM(str(tmp_path / "saved"), max_num_seqs=2, max_model_len=256)
    load_s = time.perf_counter() - t0
    leaf = again.engine.runner.checkpoint_params()["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert hasattr(leaf, "qweight") and leaf.format == "int8"
    out = again.chat(msgs, params)[0].outputs[0]
    assert out.token_ids == ref.token_ids and "Paris" in out.text
    print(f"quantize at load {convert_s:.2f}s, load saved {load_s:.2f}s")
