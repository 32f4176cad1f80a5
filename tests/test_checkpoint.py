"""Quantize once: save the quantized param tree with orbax and load it back directly."""
import json
import os
import subprocess
import sys
import time

from atlasjax import LLM, SamplingParams
from tests.server_util import tiny_model_dir


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


def test_save_command_writes_a_checkpoint_the_cli_loads(tmp_path_factory):
    # `python -m atlasjax save`: quantize once from the command line, then run from the saved directory.
    model = tiny_model_dir(tmp_path_factory)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    common = ["--max-model-len", "64", "--max-num-seqs", "1", "--dtype", "float32"]

    def run(*args):
        p = subprocess.run([sys.executable, "-m", "atlasjax", *args], env=env, cwd=root, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        return p
    saved = str(tmp_path_factory.mktemp("saved_cli"))
    run("save", "--model", model, "--quantization", "int8", *common, saved)
    assert os.path.exists(os.path.join(saved, "atlasjax_checkpoint.json"))
    prompt = ["--max-tokens", "8", "One two three"]
    want = run("generate", "--model", model, "--quantization", "int8", *common, *prompt).stdout
    got = run("generate", "--model", saved, *common, *prompt).stdout
    assert got == want and want.strip()


def test_int4_zero_points_survive_save_and_load(tmp_path_factory):
    # An int4 checkpoint keeps how its zeros are read (integer zero points) and its K order (mma
    # order), so it loads back to the same weights and the same greedy output.
    model = tiny_model_dir(tmp_path_factory)
    kw = dict(max_num_seqs=1, max_model_len=64, dtype="float32")
    llm = LLM(model, quantization="int4", **kw)
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = llm.generate(["One two three"], params)[0].outputs[0]
    saved = str(tmp_path_factory.mktemp("saved_int4"))
    llm.save(saved)
    again = LLM(saved, **kw)
    leaf = again.engine.runner.checkpoint_params()["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert leaf.format == "int4" and leaf.zero_point and leaf.zeros is not None and leaf.mma_order
    with open(os.path.join(saved, "atlasjax_checkpoint.json")) as f:   # older ones lack it: natural order
        assert any(q.get("mma_order") for q in json.load(f)["quantized"].values())
    assert again.generate(["One two three"], params)[0].outputs[0].token_ids == ref.token_ids


def test_int4_checkpoint_from_before_mma_order_loads_as_natural_order(tmp_path_factory, monkeypatch):
    # Checkpoints saved before session 14 hold int4 in natural K order and no "mma_order" key; they
    # must load as natural order (which the kernel still runs), computing what they did.
    model = tiny_model_dir(tmp_path_factory)
    kw = dict(max_num_seqs=1, max_model_len=64, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = LLM(model, quantization="int4", **kw).generate(["One two three"], params)[0].outputs[0]
    from atlasjax import quantization
    quantize = quantization.quantize
    with monkeypatch.context() as m:   # quantize as before: natural order
        m.setattr(quantization, "quantize", lambda *a, **kw: quantization.with_mma_order(quantize(*a, **kw), False))
        old = LLM(model, quantization="int4", **kw)
        saved = str(tmp_path_factory.mktemp("saved_int4_natural"))
        old.save(saved)
    meta_path = os.path.join(saved, "atlasjax_checkpoint.json")
    with open(meta_path) as f:
        meta = json.load(f)
    for q in meta["quantized"].values():
        assert q.pop("mma_order") is False
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    again = LLM(saved, **kw)
    leaf = again.engine.runner.checkpoint_params()["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert leaf.format == "int4" and not leaf.mma_order
    assert again.generate(["One two three"], params)[0].outputs[0].token_ids == ref.token_ids


def test_gguf_q4_k_two_level_rows_survive_save_and_load(tmp_path_factory):
    # A Q4_K file's two-level group rows (uint8 under float16 rows per 256) are saved as they are
    # and load back to the same weights, the same bytes and the same greedy output.
    import numpy as np

    from pallas_kernels.quant_format import dequantize
    from tests.test_gguf_blocks import _write_k_quant_llama
    path = _write_k_quant_llama(tmp_path_factory.mktemp("q4_k") / "q4_k.gguf", more_bits=False)
    kw = dict(max_num_seqs=1, max_model_len=64, dtype="float32")
    llm = LLM(path, keep_gguf_quantized=True, **kw)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = llm.generate([[1, 2, 3, 4]], params)[0].outputs[0]
    saved = str(tmp_path_factory.mktemp("saved_q4_k"))
    llm.save(saved)
    again = LLM(saved, **kw)
    before = llm.engine.runner.checkpoint_params()["layers_0"]["mlp"]["down_proj"]["kernel"]
    leaf = again.engine.runner.checkpoint_params()["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert leaf.two_level and leaf.scales.dtype == np.uint8 and leaf.super_zeros is not None
    np.testing.assert_array_equal(np.asarray(dequantize(leaf)), np.asarray(dequantize(before)))
    assert again.generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids == ref.token_ids


def _edit_meta(edit):
    def mutate(directory):
        path = os.path.join(directory, "atlasjax_checkpoint.json")
        with open(path) as f:
            meta = json.load(f)
        edit(meta)
        with open(path, "w") as f:
            json.dump(meta, f)
    return mutate


def _first_quantized(meta):
    return meta["quantized"]["layers_0/mlp/down_proj/kernel"]


def _remove_arrays(directory):
    import shutil
    shutil.rmtree(os.path.join(directory, "params"))


def _truncate_largest_array_file(directory):
    import glob
    files = [f for f in glob.glob(os.path.join(directory, "params", "**"), recursive=True) if os.path.isfile(f)]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 2)


DAMAGE = {   # what a damaged or mismatched saved checkpoint looks like -> what the error must say
    "no_config": (_edit_meta(lambda m: m.pop("config")), "no valid model config"),
    "unknown_config_field": (_edit_meta(lambda m: m["config"].update(bogus=1)), "bogus"),
    "config_from_another_model": (_edit_meta(lambda m: m["config"].update(hidden_size=2 * m["config"]["hidden_size"])),
                                  "its model config gives"),
    "quantized_shape": (_edit_meta(lambda m: _first_quantized(m).update(shape=[7, 9])), "has shape (7, 9)"),
    "quantized_format": (_edit_meta(lambda m: _first_quantized(m).update(format="int3")), "unknown format 'int3'"),
    "quantized_group_size": (_edit_meta(lambda m: _first_quantized(m).update(group_size=64)), "group rows"),
    "quantized_arrays_missing": (_edit_meta(lambda m: m["quantized"].update({"layers_0/extra/kernel": _first_quantized(m)})),
                                 "layers_0/extra/kernel"),
    "arrays_missing": (_remove_arrays, "cannot read the arrays"),
    "array_file_truncated": (_truncate_largest_array_file, "cannot read the arrays"),
    "newer_version": (_edit_meta(lambda m: m.update(version=99)), "unsupported atlasjax checkpoint version 99"),
}


def test_damaged_checkpoint_is_refused_by_name_and_the_intact_one_still_loads(tmp_path_factory):
    # Each damage raises CheckpointError saying what is wrong (no KeyError or TypeError from deep
    # inside, no model built on weights that disagree with its config); the process stays usable.
    import re
    import shutil

    import pytest

    from atlasjax.errors import CheckpointError
    model = tiny_model_dir(tmp_path_factory)
    kw = dict(max_num_seqs=1, max_model_len=64, dtype="float32")
    llm = LLM(model, quantization="int4", **kw)
    params = SamplingParams(temperature=0, max_tokens=4)
    ref = llm.generate(["One two three"], params)[0].outputs[0].token_ids
    saved = str(tmp_path_factory.mktemp("intact"))
    llm.save(saved)
    for name, (damage, message) in DAMAGE.items():
        damaged = str(tmp_path_factory.mktemp(name) / "ckpt")
        shutil.copytree(saved, damaged)
        damage(damaged)
        with pytest.raises(CheckpointError, match=re.escape(message)):
            LLM(damaged, **kw)
    assert LLM(saved, **kw).generate(["One two three"], params)[0].outputs[0].token_ids == ref
