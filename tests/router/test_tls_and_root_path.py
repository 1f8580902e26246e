"""The router process with `--ssl-keyfile`/`--ssl-certfile` (TLS on the socket it binds itself,
router/__main__.py) and `--root-path` (the prefix a proxy strips), against a self-signed
certificate made here. One router process, no node: /health is 503, which is enough."""

from __future__ import annotations

import re
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import httpx
import pytest

from pdserve.commands.router_tls import router_scheme, router_tls_context
from pdserve.router.config import RouterConfig
from pdserve.wire.child_command import python_module_command
from pdserve.wire.free_ports import free_port
from tests.tls_certificate import self_signed_certificate

KEY = "sekret-key"
READY_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tls_router(tiny_llama_dir, tmp_path_factory):
    """(base URL, key, certificate) of a router serving HTTPS under --root-path /llm with a key."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = self_signed_certificate(folder)
    output_path = folder / "router.txt"
    with open(output_path, "w") as output:
        router = subprocess.Popen(
            [*python_module_command("pdserve.router"), "--model", str(tiny_llama_dir),
             "--port", "0", "--node", f"tcp://127.0.0.1:{free_port()}",
             "--listen", f"tcp://127.0.0.1:{free_port()}", "--ssl-keyfile", str(key),
             "--ssl-certfile", str(cert), "--root-path", "/llm", "--api-key", KEY],
            stdout=output, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (found := re.search(r"listening on (\S+)", output_path.read_text())):
            assert router.poll() is None, output_path.read_text()
            assert time.monotonic() < deadline, output_path.read_text()
            time.sleep(0.05)
        yield found.group(1), key, cert
    finally:
        router.terminate()
        router.wait(60)


def test_the_router_serves_https_on_the_socket_it_bound(tls_router):
    url, _, cert = tls_router
    assert url.startswith("https://127.0.0.1:")
    trusted = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(base_url=url, verify=trusted, timeout=30) as client:
        assert client.get("/health").status_code == 503  # no node; TLS and routing work
        assert client.get("/version").json()["version"]
    with pytest.raises(httpx.HTTPError):  # plain HTTP gets no answer from a TLS socket
        httpx.get(url.replace("https://", "http://") + "/health", timeout=10)


def test_under_a_root_path_routes_and_the_key_rule_read_the_path_less_the_prefix(tls_router):
    url, _, cert = tls_router
    trusted = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(base_url=url, verify=trusted, timeout=30) as client:
        assert client.get("/v1/models").status_code == 401
        models = client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert models.status_code == 503  # the key passes; no node can serve yet
        assert "No inference node" in models.json()["error"]["message"]
        assert client.get("/metrics").status_code == 200  # open, as vLLM's


def test_the_launchers_tls_context_trusts_the_routers_own_certificate(tls_router, tiny_llama_dir):
    url, key, cert = tls_router
    config = RouterConfig(model_path=tiny_llama_dir, ssl_keyfile=str(key), ssl_certfile=str(cert))
    assert router_scheme(config) == "https"
    with pytest.raises(urllib.error.HTTPError) as answer:  # verified; /health answers 503
        urllib.request.urlopen(f"{url}/health", timeout=30, context=router_tls_context(config))
    assert answer.value.code == 503
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"{url}/health", timeout=30)  # the system's CAs: not trusted
    assert router_tls_context(RouterConfig(model_path=tiny_llama_dir)) is None
