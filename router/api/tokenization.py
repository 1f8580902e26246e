"""`POST /tokenize` and `POST /detokenize`, with vLLM's request and response shapes.

  /tokenize    {"model", "prompt", "add_special_tokens"?, "return_token_strs"?} or
               {"model", "messages", "add_generation_prompt"?, "continue_final_message"?,
                "chat_template_kwargs"?, "return_token_strs"?}
               -> {"count", "max_model_len", "tokens"} (and "token_strs" when asked)
  /detokenize  {"model", "tokens"} -> {"prompt"}

Bounded like the completions routes: the body's size, the model (404), fields pdserve does not
implement and unknown fields (router/api/unsupported.py), the template options
(router/api/template_options.py), the prompt's
characters against the context (400, before tokenizing), token ids within the tokenizer's
vocabulary (400 naming `tokens`). Tokenizing and decoding run in the app's worker threads,
never on the event loop, each holding one place in the router's admission queue meanwhile
(429 first, before the body is read, when the queue is full: router/api/overload_gate.py).
`/tokenize` needs a live node for `max_model_len` (503 otherwise); `/detokenize` needs none.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from pdserve.router.api.routes import read_request
from pdserve.router.api.schemas import DetokenizeRequest, TokenizeRequest
from pdserve.router.api.validation import chat_prompt
from pdserve.router.errors import invalid
from pdserve.router.state import RouterState


async def tokenize(request: Request) -> dict[str, Any]:
    state: RouterState = request.app.state.router
    req = await read_request(request, state, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("Give either 'prompt' or 'messages'.", "prompt")
    if req.messages is not None and req.add_special_tokens:
        raise invalid(
            "'add_special_tokens' is not supported with 'messages': the chat template writes "
            "the special tokens itself.",
            "add_special_tokens",
        )
    limits = state.limits_now()
    max_model_len, _ = limits()
    if req.prompt is not None:
        state.check_prompt_chars(len(req.prompt), limits, "prompt")
    else:
        num_chars = sum(len(message.text()) for message in req.messages)
        state.check_prompt_chars(num_chars, limits, "messages")
    with state.admission.holding():
        tokens, token_strs = await state.tokenizer_threads.run(
            _tokenize, req, state.tokenizer, state.config.default_chat_template_kwargs
        )
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}
    if token_strs is not None:
        out["token_strs"] = token_strs
    return out


def _tokenize(
    req: TokenizeRequest, tokenizer: Any, default_kwargs: dict[str, Any]
) -> tuple[list[int], list[str] | None]:
    """The token ids (and their strings when asked); 400 for text no tokenizer encodes;
    `default_kwargs`: the server's chat template variables."""
    if req.prompt is None:
        tokens = chat_prompt(req, tokenizer, None, default_kwargs)
    else:
        try:
            tokens = list(
                tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
            )
        except Exception:  # noqa: BLE001 (whatever the tokenizer refuses is the client's text)
            raise invalid(
                "'prompt' is text the model's tokenizer cannot encode.", "prompt"
            ) from None
    if not req.return_token_strs:
        return tokens, None
    return tokens, [tokenizer.convert_ids_to_tokens(t) for t in tokens]


async def detokenize(request: Request) -> dict[str, Any]:
    state: RouterState = request.app.state.router
    req = await read_request(request, state, DetokenizeRequest)
    vocab_size = len(state.tokenizer)
    if any(not 0 <= t < vocab_size for t in req.tokens):
        raise invalid(f"token ids in 'tokens' must be in [0, {vocab_size}).", "tokens")
    with state.admission.holding():
        text = await state.tokenizer_threads.run(state.tokenizer.decode, req.tokens)
    return {"prompt": text}
