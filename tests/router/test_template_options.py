"""The bounds on a chat request's template options (router/api/template_options.py,
text/template_kwargs.py), checked without a server: what passes, what the server's defaults add,
and the field each refusal names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.router.api.template_options import template_options
from pdserve.router.errors import APIError
from pdserve.text.template_kwargs import MAX_KWARGS_BYTES, MAX_KWARGS_DEPTH

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def request(kwargs=None, add_generation_prompt=True, continue_final_message=False):
    return SimpleNamespace(
        chat_template_kwargs=kwargs, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )


def nested(levels: int):
    """A value that is `levels` arrays deep."""
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


def test_options_within_bounds_pass_through():
    options = template_options(
        request({"enable_thinking": False, "deep": nested(MAX_KWARGS_DEPTH - 1)}, False, True),
        SPECIAL,
    )
    assert options.kwargs["enable_thinking"] is False
    assert (options.add_generation_prompt, options.continue_final_message) == (False, True)
    assert template_options(request(), SPECIAL).kwargs == {}


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (request(continue_final_message=True), "continue_final_message"),
        (request({"deep": nested(MAX_KWARGS_DEPTH)}), "chat_template_kwargs"),
        (request({"big": "x" * MAX_KWARGS_BYTES}), "chat_template_kwargs"),
        (request({"1st": 1}), "chat_template_kwargs"),
        (request({"tools": []}), "chat_template_kwargs.tools"),
        (request({"add_generation_prompt": False}), "chat_template_kwargs.add_generation_prompt"),
        (request({"bos_token": ""}), "chat_template_kwargs.bos_token"),
    ],
    ids=["both-ends", "too-deep", "too-big", "not-a-name", "tools", "option", "special-token"],
)
def test_out_of_bounds_options_are_400_naming_the_field(req, param):
    with pytest.raises(APIError) as caught:
        template_options(req, SPECIAL)
    assert caught.value.status == 400 and caught.value.param == param


def test_the_servers_defaults_sit_under_the_requests_own():
    defaults = {"enable_thinking": False, "style": "brief"}
    options = template_options(request({"enable_thinking": True}), SPECIAL, defaults)
    assert options.kwargs == {"enable_thinking": True, "style": "brief"}
    assert template_options(request(), SPECIAL, defaults).kwargs == defaults
