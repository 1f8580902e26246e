"""Property-based fuzz of the HTTP API: any JSON body gets a JSON answer, never a 5xx."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.default_model

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                      children, max_size=4),
    max_leaves=8,
)
SMALL_MAX_TOKENS = st.integers(-3, 4) | JSON_VALUES
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "bogus"]) | JSON_VALUES,
     "content": st.text(max_size=30) | JSON_VALUES}
)
COMMON_FIELDS = {
    "temperature": st.floats(-1, 3) | JSON_VALUES,
    "top_p": st.floats(-0.5, 1.5) | JSON_VALUES,
    "top_k": st.integers(-3, 50) | JSON_VALUES,
    "seed": st.integers(-5, 2**31) | JSON_VALUES,
    "n": st.integers(-1, 12) | JSON_VALUES,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=6) | JSON_VALUES,
    "stream": st.booleans() | JSON_VALUES,
    "min_tokens": st.integers(-2, 6) | JSON_VALUES,
    "ignore_eos": st.booleans() | JSON_VALUES,
    "user": st.text(max_size=10) | JSON_VALUES,
}


def bodies(model: str, endpoint_fields: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"model": st.just(model) | JSON_VALUES, "max_tokens": SMALL_MAX_TOKENS},
        optional={**COMMON_FIELDS, **endpoint_fields},
    )


def check(url: str, path: str, body: object) -> None:
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code < 500, response.text[:200]
    if response.status_code >= 400:
        assert "message" in response.json()["error"]


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {"prompt": st.text(max_size=40) | st.lists(
            st.integers(-5, 60_000), max_size=8) | JSON_VALUES,
            "logprobs": st.integers(-1, 25) | JSON_VALUES}),
        ("/v1/chat/completions", {"messages": st.lists(MESSAGE, max_size=3) | JSON_VALUES,
                                  "logprobs": st.booleans() | JSON_VALUES,
                                  "top_logprobs": st.integers(-1, 25) | JSON_VALUES}),
    ],
)
def test_fuzzed_bodies_never_get_a_server_error(pdserve_server, model_name, path, fields):
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies(model_name, fields))
    def run(body):
        check(pdserve_server, path, body)

    run()
