"""HTTPS with `--ssl-keyfile`/`--ssl-certfile` (vLLM's flags): a self-signed certificate made
here, /health and a completion over TLS verified against it, and options checked before the
model loads (both files or neither, files that exist, a key that matches its certificate)."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from process_guard import dies_with_us
from server_utils import API_KEY, MODEL, STARTUP_TIMEOUT_S, RunningServer
from tiers import slow_fixture

from pagedllm.entrypoints.openai.server_config import ServerConfig


def make_certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key."""
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-nodes", "-days", "2", "-subj", "/CN=localhost",
            "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-keyout", str(key), "-out", str(cert),
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
        preexec_fn=dies_with_us(),
    )  # fmt: skip
    return key, cert


@pytest.fixture(scope="module")
@slow_fixture  # openssl in a process
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("tls"), "server")


class TlsServer(RunningServer):
    """`pagedllm serve` over HTTPS; requests verify the server against `cert`."""

    def __init__(self, args: list[str], log_path: Path, cert: Path) -> None:
        self.verify = ssl.create_default_context(cafile=str(cert))
        super().__init__(args, log_path, api_key=API_KEY)

    def _wait_healthy(self) -> None:
        self.base_url = self.base_url.replace("http://", "https://")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if self.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def get(self, path: str, **kwargs) -> httpx.Response:
        kwargs.setdefault("timeout", 60)
        return httpx.get(self.base_url + path, headers=self.headers, verify=self.verify, **kwargs)

    def post(self, path: str, body=None, **kwargs) -> httpx.Response:
        return super().post(path, body, verify=self.verify, **kwargs)


@pytest.mark.slow
def test_serves_https_verified_against_its_certificate(tmp_path, certificate):
    key, cert = certificate
    server = TlsServer(
        ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)], tmp_path / "server.log", cert
    )
    try:
        assert server.base_url.startswith("https://127.0.0.1:")
        assert server.get("/health").status_code == 200
        response = server.post(
            "/v1/completions",
            {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3},
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
        # TLS for real: a client that does not trust the certificate is refused, and plain
        # HTTP gets no answer from the port.
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(server.base_url + "/health", timeout=10)
        plain = server.base_url.replace("https://", "http://") + "/health"
        with pytest.raises(httpx.HTTPError):
            httpx.get(plain, timeout=10)
        assert "Serving" in server.log() and "on https://" in server.log()
    finally:
        assert server.stop() == 0, server.log()


def serve_exits(*args: str) -> str:
    """`pagedllm serve ARGS`'s error when it refuses to start (before loading the model)."""
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=dies_with_us(),
    )
    assert result.returncode == 2, result.stdout + result.stderr
    return result.stderr


def test_bad_tls_options_stop_the_server_before_it_starts(tmp_path, certificate):
    key, cert = certificate
    other_key, _ = make_certificate(tmp_path, "other")
    assert "both or neither" in serve_exits("--ssl-keyfile", str(key))
    mismatched = serve_exits("--ssl-keyfile", str(other_key), "--ssl-certfile", str(cert))
    assert "cannot load" in mismatched


def test_server_config_checks_tls(certificate, tmp_path):
    key, cert = certificate
    names = ("m",)
    config = ServerConfig(names, ssl_keyfile=str(key), ssl_certfile=str(cert))
    assert (config.ssl_keyfile, config.ssl_certfile) == (str(key), str(cert))
    ServerConfig(
        names, ssl_keyfile=str(key), ssl_certfile=str(cert), ssl_ca_certs=str(cert), ssl_cert_reqs=2
    )
    for kwargs, message in [
        ({"ssl_certfile": str(cert)}, "both or neither"),
        ({"ssl_keyfile": str(key), "ssl_certfile": str(tmp_path)}, "not a readable file"),
        ({"ssl_keyfile": str(key), "ssl_certfile": str(cert), "ssl_cert_reqs": 2}, "ssl_ca_certs"),
        ({"ssl_keyfile": str(key), "ssl_certfile": str(cert), "ssl_cert_reqs": 5}, "must be 0"),
        ({"ssl_keyfile": str(cert), "ssl_certfile": str(cert)}, "cannot load"),
        ({"ssl_cert_reqs": 1}, "need ssl_certfile"),
    ]:
        with pytest.raises(ValueError, match=message):
            ServerConfig(names, **kwargs)
