"""`python -m atlasjax serve` on a preset: random weights of a published shape, nothing downloaded.

    python -m atlasjax.bench.preset_server --preset llama-3.1-8b [serve flags: --port, --max-num-seqs ...]

It runs the real server (`atlasjax.__main__.main(["serve", ...])`) and only swaps what the engine
loads: `atlasjax.model_source.load_for_engine` returns the preset (quantized with the server's
own --quantization and --quantize-lm-head, or laid out as a GGUF file with `--quantization
gguf-q4_k_m` etc.: atlasjax/bench/gguf_layouts.py), with the synthetic word tokenizer of
`presets.synthetic_tokenizer`, so every token streams as its own chunk. The served model name
defaults to the preset's name. With --engine-process the engine's process is patched the same way.
"""
from __future__ import annotations

import argparse
import functools
import sys

from atlasjax.bench.gguf_layouts import LAYOUTS
from atlasjax.bench.presets import PRESETS, load_preset, progress, weights_label


def install_preset(preset: str, layout: str | None) -> None:
    """Make this process's engine load `preset` (random weights) whatever model it is asked for."""
    import atlasjax.model_source  # noqa: PLC0415

    def load_for_engine(config, dtype):
        quantization = layout or config.quantization
        label = weights_label(quantization, config.quantize_lm_head)
        progress(f"serving preset {preset} with random weights" + (f" ({label})" if label else ""))
        return load_preset(preset, dtype, quantization, config.seed, quantize_lm_head=config.quantize_lm_head,
                           group_size=None if layout else config.quantization_group_size,
                           symmetric=None if layout else config.quantization_symmetric)
    atlasjax.model_source.load_for_engine = load_for_engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--quantization", default=None)
    args, rest = p.parse_known_args(argv)
    layout = args.quantization if args.quantization in LAYOUTS else None   # the preset's business, not the server's
    if args.quantization and not layout:
        rest += ["--quantization", args.quantization]   # int8 / fp8 / int4: the server's own flag

    install_preset(args.preset, layout)
    import serving.cli  # noqa: PLC0415
    # --engine-process: the engine's process patches itself too (named by module: `-m` runs this file as __main__)
    from atlasjax.bench import preset_server  # noqa: PLC0415
    serving.cli.engine_process_setup = functools.partial(preset_server.install_preset, args.preset, layout)
    if "--served-model-name" not in rest:
        rest += ["--served-model-name", args.preset]
    from atlasjax.__main__ import main as atlasjax_main  # noqa: PLC0415
    return atlasjax_main(["serve", *rest])


if __name__ == "__main__":
    sys.exit(main())
