"""End to end: `pdserve serve --ssl-keyfile K --ssl-certfile C` (colocated, a tiny model) with
a self-signed certificate made here. The openai client, over an httpx client that trusts that
certificate, gets a completion over HTTPS; a client that does not trust it is refused, and so
is plain HTTP on the same port; ServeProcess reports the https URL."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest

from pdserve.commands.serve_process import ServeProcess
from tests.tls_certificate import self_signed_certificate


@pytest.fixture(scope="module")
def https_server(tiny_llama_dir, tmp_path_factory):
    """(the running server, its certificate file)."""
    key, cert = self_signed_certificate(tmp_path_factory.mktemp("tls"))
    server = ServeProcess(
        ["--model", str(tiny_llama_dir), "--colocated", "--dtype", "float32",
         "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)], ready_timeout_s=240,
    )
    try:
        yield server, cert
    finally:
        server.close()


def openai_client(url: str, verify: ssl.SSLContext | bool) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0,
        http_client=httpx.Client(verify=verify, timeout=60),
    )


def test_serve_process_reports_the_https_url(https_server):
    server, _ = https_server
    assert server.url == f"https://127.0.0.1:{server.port}"


def test_a_client_trusting_the_certificate_gets_a_completion_over_https(https_server):
    server, cert = https_server
    client = openai_client(server.url, ssl.create_default_context(cafile=str(cert)))
    model = client.models.list().data[0].id
    completion = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=4, temperature=0
    )
    assert completion.usage.completion_tokens == 4
    assert completion.choices[0].finish_reason == "length"


def test_a_client_not_trusting_the_certificate_is_refused(https_server):
    server, _ = https_server
    with pytest.raises(openai.APIConnectionError) as refused:
        openai_client(server.url, verify=True).models.list()
    assert "CERTIFICATE_VERIFY_FAILED" in repr(refused.value.__cause__)


def test_plain_http_on_the_same_port_gets_no_answer(https_server):
    server, _ = https_server
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
