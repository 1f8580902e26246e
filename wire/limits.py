"""Bounds on the numbers a request carries, shared by the router's checks and the engine's.

The router refuses a request outside them with a 400 naming the field; the engine's
`SamplingParams` refuses the same values again, so a node is safe without a router in front.
"""

from __future__ import annotations

INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20
# Below this a temperature is greedy (as in vLLM): dividing logits by it would overflow them.
GREEDY_TEMPERATURE_BELOW = 1e-5
# Far past where sampling is uniform for any real model's logits; keeps them finite in fp32.
MAX_TEMPERATURE = 100.0
# torch.Generator.manual_seed takes [-2**63, 2**64); requests keep to signed 64-bit.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# OpenAI's range for presence_penalty and for frequency_penalty.
MIN_PENALTY, MAX_PENALTY = -2.0, 2.0
# repetition_penalty is in (0, MAX_REPETITION_PENALTY] (1 is off). vLLM takes any positive value;
# at 2 a seen token's positive logit is already halved and its negative logit doubled, which
# pushes the model off every word of its prompt; larger values only wreck the text (and are
# usually a typo, 12 for 1.2), so they are refused rather than obeyed.
MAX_REPETITION_PENALTY = 2.0
# OpenAI's range for each logit_bias value; a request biases at most MAX_LOGIT_BIAS_ENTRIES ids.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# A request's stop_token_ids, at most.
MAX_STOP_TOKEN_IDS = 1024
# structured_output (wire/structured_output.py): a json_schema (as compact JSON text) or a
# grammar has at most MAX_GRAMMAR_CHARS characters, and so have a choice list's strings together;
# a regex at most MAX_REGEX_CHARS; a choice list at most MAX_CHOICES strings. A schema nests at
# most MAX_JSON_SCHEMA_DEPTH objects and arrays: SamplingParams travel as msgpack maps, whose
# encoder recurses once per level (it fails past about 480), and realistic schemas nest about 20.
MAX_GRAMMAR_CHARS = 128 * 1024
MAX_REGEX_CHARS = 16 * 1024
MAX_CHOICES = 1024
MAX_JSON_SCHEMA_DEPTH = 64
# prompt_logprobs (and echo with logprobs) score at most this many prompt tokens: a node sends a
# prompt's scores in one TokenUpdate, at most 323 msgpack bytes per token with 20 alternatives,
# so 131,072 tokens (42 MB) stay within wire/messages.py's 64 MiB message limit.
MAX_PROMPT_LOGPROBS_TOKENS = 131_072
# n > 1 choices of one prompt travel in one Generate (wire/messages.py): at most this many. The
# router's `--max-n` must not exceed it.
MAX_CHOICES_PER_PROMPT = 128
