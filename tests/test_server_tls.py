"""HTTPS (`serve --ssl-certfile --ssl-keyfile`, vLLM's flags): a server on a self-signed certificate answers
over TLS and prints an https URL; a missing half or a key that does not fit stops the start with the reason,
before the model loads."""
from __future__ import annotations

import shutil
import ssl
import subprocess
import sys

import httpx
import pytest

from tests.server_util import REPO, ServerProcess, tiny_model_dir


def _self_signed(directory, name: str) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert, key = str(directory / f"{name}.pem"), str(directory / f"{name}.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_a_server_with_a_certificate_answers_over_https(tmp_path, tmp_path_factory):
    cert, key = _self_signed(tmp_path, "server")
    server = ServerProcess(tiny_model_dir(tmp_path_factory), str(tmp_path / "server.log"),
                           "--ssl-certfile", cert, "--ssl-keyfile", key)
    try:
        assert server.url.startswith("https://127.0.0.1:")
        r = httpx.get(server.url + "/health", verify=ssl.create_default_context(cafile=cert), timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=10)
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("case", ["half", "mismatch"])
def test_a_bad_certificate_stops_the_start(tmp_path, case):
    cert, key = _self_signed(tmp_path, "one")
    flags = ["--ssl-certfile", cert] if case == "half" else \
        ["--ssl-certfile", cert, "--ssl-keyfile", _self_signed(tmp_path, "two")[1]]
    done = subprocess.run([sys.executable, "-m", "atlasjax", "serve", "--port", "0", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    want = "needs both --ssl-certfile and --ssl-keyfile" if case == "half" else "cannot use --ssl-certfile"
    assert want in done.stderr and "Traceback" not in done.stderr
