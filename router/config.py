"""Router settings: one dataclass, built by the CLI or directly by tests.

Each operator option's flag and help is its field's `option` metadata (wire/config_flags.py):
`python -m pdserve.router` generates its parser from them, and `pdserve serve` those it does not
decide
itself (`launcher_sets`); fields without one are set by code.
"""

from __future__ import annotations

import json
import math
import operator
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.router.cluster.node_registry import parse_node_spec
from pdserve.router.cluster.prefill_placement import DisaggPolicy, PlacementSettings
from pdserve.router.cluster.stats_log import STATS_LOG_INTERVAL_S
from pdserve.text.reasoning_split import ReasoningStyle
from pdserve.text.template_kwargs import check_template_kwargs
from pdserve.wire.cluster_auth import SECRET_ENV, ClusterAuth
from pdserve.wire.config_flags import option
from pdserve.wire.limits import MAX_CHOICES_PER_PROMPT, MAX_LOGPROBS

# `pdserve serve` hands the router its settings as JSON here: {"router": {RouterConfig field:
# value}, "log": {LogSettings field: value}}; flags given override them (router/__main__.py).
CONFIG_ENV = "PDSERVE_ROUTER_CONFIG"
API_KEY_ENV = "PDSERVE_API_KEY"
# The CORS lists (`--allowed-origins` ...): at most this many entries of this many characters.
MAX_CORS_ENTRIES = 64
MAX_CORS_ENTRY_CHARS = 512
MAX_ROOT_PATH_CHARS = 256


def served_names(names: list[str]) -> dict[str, Any]:
    """`--served-model-name A B ...`: A is the model's name, the rest its aliases."""
    return {"served_model_name": names[0], "served_model_aliases": tuple(names[1:])}


def chat_template_source(value: str) -> str:
    """`--chat-template`: a file's template, or the template itself (checked to parse)."""
    from pdserve.text.tokenizer import read_chat_template  # jinja2 and tokenizers, when given only

    return read_chat_template(value)


def json_string_list(flag: str) -> Callable[[str], list[str]]:
    """A flag's value as vLLM takes it, a JSON list of strings (`'["https://a.example"]'`)."""

    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ValueError(f"{flag} is {text!r}; expected a JSON list of strings, e.g. '[\"*\"]'")
        return value

    return parse


def _check_string_list(name: str, value: object) -> None:
    well_formed = isinstance(value, list) and all(isinstance(item, str) for item in value)
    if not well_formed or len(value) > MAX_CORS_ENTRIES or any(  # type: ignore[arg-type]
        not 0 < len(item) <= MAX_CORS_ENTRY_CHARS for item in value  # type: ignore[union-attr]
    ):
        flag = "--" + name.replace("_", "-")
        raise ValueError(
            f"{name} ({flag}) is {value!r}; expected a list of at most {MAX_CORS_ENTRIES} "
            f"strings of 1 to {MAX_CORS_ENTRY_CHARS} characters"
        )


@dataclass
class RouterConfig:
    """Everything the router needs to know; no other configuration exists.

    `node_addresses` are the nodes' PULL addresses (`tcp://host:port`), optionally prefixed
    with the node's id (`ID=tcp://host:port`) so NodeStats can be matched to an address when
    several nodes are configured. `listen_address` is where the router binds its PULL socket.
    `cluster_auth` (wire/cluster_auth.py) secures every ZeroMQ link to the nodes; without a
    secret the listen and node addresses must be loopback ones.
    """

    model_path: str | Path = option(  # noqa: RUF009 (a dataclasses.field)
        flag="--model", launcher_sets=True, metavar="PATH",
        help="model folder, for the tokenizer unless --tokenizer (required)",
    )
    # The folder whose tokenizer replaces the model folder's (`pdserve serve --tokenizer`
    # resolves a Hub id to one).
    tokenizer_path: str | None = option(
        None, flag="--tokenizer", launcher_sets=True, metavar="PATH",
        help="a folder whose tokenizer files replace the model folder's (default: the model's)",
    )
    served_model_name: str | None = option(
        None, flag="--served-model-name", nargs="+", metavar="NAME", to_fields=served_names,
        launcher_sets=True, help="names requests may send as `model`; /v1/models lists the "
        "first (default: the model path as given)",
    )
    # Further names requests may send as `model` (`--served-model-name A B`: B); /v1/models
    # lists `model_name` alone, as vLLM does.
    served_model_aliases: tuple[str, ...] = field(
        default=(), metadata={"set_by": "--served-model-name"}
    )
    # The chat template's source, replacing the model folder's.
    chat_template: str | None = option(
        None, flag="--chat-template", metavar="FILE_OR_TEMPLATE", to_field=chat_template_source,
        help="a Jinja chat template, or a file holding one, instead of the model's",
    )
    # Template variables every chat request gets unless it gives its own
    # (router/api/template_options.py), as vLLM's --default-chat-template-kwargs.
    default_chat_template_kwargs: dict[str, Any] = option(  # noqa: RUF009 (a dataclasses.field)
        flag="--default-chat-template-kwargs", default_factory=dict, metavar="JSON_OBJECT",
        to_field=json.loads,
        help="chat template variables for every request that does not set them in its "
        "chat_template_kwargs, a JSON object (e.g. '{\"enable_thinking\": false}')",
    )
    # How a chat choice's thinking is told from its answer (text/reasoning_split.py).
    reasoning_parser: str | None = option(
        None, flag="--reasoning-parser", choices=tuple(ReasoningStyle),
        help="return a chat answer's <think> text as `reasoning_content`, apart from "
        "`content`: qwen3 (thinks only after an opening <think>) or deepseek_r1 (thinks from "
        "the start); default: none, the text is all content",
    )
    # The names /metrics exposes (router/vllm_metric_names.py).
    metrics_prefix: str = option(
        "pdserve", flag="--metrics-prefix", choices=("pdserve", "vllm"),
        help="the names of /metrics: pdserve_* (default), or vllm: vLLM's exact names "
        "(vllm:time_to_first_token_seconds, ...) where vLLM has the metric, so a vLLM "
        "dashboard works unchanged",
    )
    host: str = option("127.0.0.1", flag="--host", launcher_sets=True, help="HTTP bind address")
    port: int = option(
        8000, flag="--port", launcher_sets=True, help="HTTP port; 0: one the OS picks"
    )
    node_addresses: list[str] = option(  # noqa: RUF009 (a dataclasses.field)
        flag="--node", default_factory=list, repeat=True, required=True, launcher_sets=True,
        metavar="ADDR", help="a node's PULL address, [ID=]tcp://HOST:PORT (required, "
        "repeatable; nodes may also join by their heartbeat)",
    )
    listen_address: str = option(
        "tcp://127.0.0.1:5600", flag="--listen", required=True, launcher_sets=True,
        metavar="ADDR", help="the router's PULL bind address (required)",
    )
    api_key: str | None = option(
        None, flag="--api-key", env=API_KEY_ENV, metavar="KEY",
        help="the /v1 routes then need `Authorization: Bearer KEY`, as vLLM's (the others "
        "too with --api-key-guards-every-route)",
    )
    # Which routes the key guards (router/api/auth.py): vLLM's /v1/ ones, or every one but the
    # liveness probes.
    api_key_guards_every_route: bool = option(
        False, flag="--api-key-guards-every-route", switch=True,
        help="with --api-key, every route needs the key (/metrics, /tokenize, /detokenize, "
        "/version too), not only /v1; /health and /ping stay open for probes",
    )
    # CORS, as vLLM's (Starlette's CORSMiddleware, router/api/app.py): on, every origin.
    allowed_origins: list[str] = option(  # noqa: RUF009 (a dataclasses.field)
        flag="--allowed-origins", default_factory=lambda: ["*"], metavar="JSON_LIST",
        to_field=json_string_list("--allowed-origins"),
        help='CORS: the origins browsers may call from, a JSON list (default: \'["*"]\', any)',
    )
    allowed_methods: list[str] = option(  # noqa: RUF009 (a dataclasses.field)
        flag="--allowed-methods", default_factory=lambda: ["*"], metavar="JSON_LIST",
        to_field=json_string_list("--allowed-methods"),
        help='CORS: the methods allowed, a JSON list (default: \'["*"]\')',
    )
    allowed_headers: list[str] = option(  # noqa: RUF009 (a dataclasses.field)
        flag="--allowed-headers", default_factory=lambda: ["*"], metavar="JSON_LIST",
        to_field=json_string_list("--allowed-headers"),
        help='CORS: the request headers allowed, a JSON list (default: \'["*"]\')',
    )
    allow_credentials: bool = option(
        False, flag="--allow-credentials", switch=True,
        help="CORS: browsers may send credentials (cookies, authorization) cross-origin",
    )
    # Behind a proxy that strips a path prefix: the prefix (uvicorn's root_path, as vLLM's).
    root_path: str = option(
        "", flag="--root-path", metavar="PREFIX",
        help="the path prefix a proxy in front strips, e.g. /llm (default: none)",
    )
    # TLS on the router's HTTP socket (router/__main__.py): both files, or neither.
    ssl_keyfile: str | None = option(
        None, flag="--ssl-keyfile", metavar="FILE",
        help="the TLS private key (PEM): the router then serves HTTPS; needs --ssl-certfile",
    )
    ssl_certfile: str | None = option(
        None, flag="--ssl-certfile", metavar="FILE",
        help="the TLS certificate chain (PEM); needs --ssl-keyfile",
    )
    max_body_bytes: int = 1 << 20
    max_n: int = option(8, flag="--max-n", metavar="N", help="largest `n` a request may ask for")
    # Completions with a list of prompts: prompts x n per request (router/api/prompts.py).
    max_choices: int = 64
    max_stop: int = 4
    # The most alternatives a request may ask for per token (logprobs, top_logprobs,
    # prompt_logprobs), as vLLM's --max-logprobs; at most the wire's MAX_LOGPROBS.
    max_logprobs: int = option(
        MAX_LOGPROBS, flag="--max-logprobs", metavar="N",
        help=f"the most log-probabilities per token a request may ask for (0 to {MAX_LOGPROBS})",
    )
    # Admission: sub-requests (n per request) accepted and not yet started (no token back),
    # and their prompt tokens; past either bound the router answers 429 (router/cluster/admission.py).
    max_queued_requests: int = option(
        1024, flag="--max-queued-requests", aliases=("--max-waiting-requests",), metavar="N",
        help="requests (n choices each) admitted and not started yet; past it, 429 "
        "(--max-waiting-requests is the old name)",
    )
    max_queued_tokens: int = option(
        1 << 20, flag="--max-queued-tokens", metavar="N",
        help="prompt tokens of the requests admitted and not started yet; past it, 429",
    )
    # A request whose prefill would start later than this is refused (429) at once: the node
    # that would compute its prompt has more queued prompt tokens than it prefills in this
    # time (its measured speed), or a request waiting there is already this old
    # (router/cluster/queue_delay.py).
    max_queue_delay_s: float = option(
        30.0, flag="--max-queue-delay", metavar="SECONDS",
        help="refuse (429) a request that would wait longer than this before its prefill "
        "starts: queued prompt tokens / the node's measured prefill speed, or the age of the "
        "oldest request still waiting there",
    )
    # Where a prompt sent to a decode node is computed (router/cluster/prefill_placement.py).
    disagg_policy: str = option(
        PlacementSettings.policy.value, flag="--disagg-policy", choices=tuple(DisaggPolicy),
        help="where a decode node's prompts are computed: always on a prefill node, never "
        "(the decode node computes them, as a colocated node), or auto per request (short "
        "prompts and a long prefill queue stay on the decode node)",
    )
    local_prefill_tokens: int = option(
        PlacementSettings.local_prefill_tokens, flag="--local-prefill-tokens", metavar="N",
        help="--disagg-policy auto: a prompt of at most this many tokens the decode node lacks "
        "is computed there",
    )
    local_prefill_queue_delay_s: float = option(
        PlacementSettings.local_prefill_queue_delay_s, flag="--local-prefill-queue-delay",
        metavar="SECONDS",
        help="--disagg-policy auto: a longer prompt is computed on the decode node when the "
        "prefill node would have computed it (its queue and the prompt itself) only after "
        "this and the decode node sooner",
    )
    # Streaming: a write to the client blocked this long aborts the request; at most this many
    # tokens wait in the router for a client that reads slower than the node generates.
    stream_stall_timeout_s: float = option(
        30.0, flag="--stream-stall-timeout", metavar="SECONDS",
        help="a stream whose client reads nothing for this long is aborted",
    )
    max_stream_buffer_tokens: int = option(
        8192, flag="--max-stream-buffer-tokens", metavar="N",
        help="tokens the router holds for a stream whose client reads slower than the model "
        "writes; past it the request is aborted",
    )
    # A node whose process is alive is down after this long without a heartbeat (nodes send
    # one every 0.5 s from a thread of their own); a node whose process exits is down at once,
    # its connection closing. Why 30 s: router/cluster/node_registry.py.
    node_timeout_s: float = option(
        30.0, flag="--node-timeout", metavar="SECONDS",
        help="a node whose process is alive but silent is down after this long without a "
        "heartbeat (a node whose process exits is down at once: its connection closes)",
    )
    # On SIGTERM, requests in flight get this long to finish (router/api/drain.py).
    drain_timeout_s: float = option(
        30.0, flag="--drain-timeout", metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may still run",
    )
    cluster_auth: ClusterAuth = option(  # noqa: RUF009 (a dataclasses.field)
        flag="--cluster-secret", default_factory=ClusterAuth.none, env=SECRET_ENV,
        to_field=ClusterAuth.from_secret, launcher_sets=True, metavar="SECRET",
        help=f"shared with every node (default: ${SECRET_ENV}); needed when --listen or a "
        "--node address is not a loopback one",
    )
    # A request's `priority` (lower is served first) reorders everyone else's: a right the
    # operator gives to the clients of this server, not one any client takes.
    allow_client_priority: bool = option(
        False, flag="--allow-client-priority", switch=True,
        help="let requests set `priority` (lower is served first); without it a request "
        "with a priority other than 0 is refused with 400",
    )
    # Logs: one INFO line per request (router/api/access_log.py), and every
    # `stats_log_interval_s` one per node that had traffic (router/cluster/stats_log.py).
    log_requests: bool = option(
        True, flag="--enable-log-requests", off_flag="--disable-log-requests",
        help="one access line per request (vLLM's newer spelling)",
        off_help="no access line per request (vLLM's older spelling)",
    )
    log_stats: bool = option(
        True, flag="--disable-log-stats", switch=True, to_field=operator.not_,
        help="no periodic stats line per node (vLLM's spelling)",
    )
    stats_log_interval_s: float = STATS_LOG_INTERVAL_S

    def __post_init__(self) -> None:
        self.served_model_aliases = tuple(self.served_model_aliases)  # a list, from JSON
        nodes = [("--node", parse_node_spec(spec)[1]) for spec in self.node_addresses]
        self.cluster_auth.check_addresses([("--listen", self.listen_address), *nodes])
        for name in (
            "max_queued_requests", "max_queued_tokens", "max_stream_buffer_tokens", "max_choices"
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is {value!r}; expected an integer >= 1")
        if not 1 <= self.max_n <= MAX_CHOICES_PER_PROMPT:
            raise ValueError(f"max_n is {self.max_n!r}; expected 1 to {MAX_CHOICES_PER_PROMPT}")
        if not 0 < self.max_queue_delay_s <= 3600:
            raise ValueError(
                f"max_queue_delay_s is {self.max_queue_delay_s}; expected (0, 3600] s"
            )
        if isinstance(self.max_logprobs, bool) or not (
            isinstance(self.max_logprobs, int) and 0 <= self.max_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"max_logprobs is {self.max_logprobs!r}; expected 0 to {MAX_LOGPROBS}")
        if self.reasoning_parser is not None and self.reasoning_parser not in tuple(
            ReasoningStyle
        ):
            raise ValueError(
                f"reasoning_parser is {self.reasoning_parser!r}; expected one of "
                f"{', '.join(ReasoningStyle)}"
            )
        if self.metrics_prefix not in ("pdserve", "vllm"):
            raise ValueError(
                f"metrics_prefix is {self.metrics_prefix!r}; expected pdserve or vllm"
            )
        if self.disagg_policy not in tuple(DisaggPolicy):
            raise ValueError(
                f"disagg_policy is {self.disagg_policy!r}; expected one of "
                f"{', '.join(DisaggPolicy)}"
            )
        if isinstance(self.local_prefill_tokens, bool) or not (
            isinstance(self.local_prefill_tokens, int) and 0 <= self.local_prefill_tokens <= 1 << 20
        ):
            raise ValueError(
                f"local_prefill_tokens is {self.local_prefill_tokens!r}; expected 0 to {1 << 20}"
            )
        if not 0 < self.local_prefill_queue_delay_s <= 3600:
            raise ValueError(
                f"local_prefill_queue_delay_s is {self.local_prefill_queue_delay_s}; "
                "expected (0, 3600] s"
            )
        if not 0 < self.stats_log_interval_s <= 3600:
            raise ValueError(
                f"stats_log_interval_s is {self.stats_log_interval_s}; expected (0, 3600] s"
            )
        self.default_chat_template_kwargs = check_template_kwargs(
            self.default_chat_template_kwargs, field="--default-chat-template-kwargs"
        )
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            _check_string_list(name, getattr(self, name))
        self._check_root_path()
        self._check_tls_files()
        if not (0 < self.node_timeout_s and math.isfinite(self.node_timeout_s)):
            raise ValueError(f"node_timeout_s is {self.node_timeout_s}; expected a positive time")
        if not (0 <= self.drain_timeout_s and math.isfinite(self.drain_timeout_s)):
            raise ValueError(f"drain_timeout_s is {self.drain_timeout_s}; expected 0 s or more")
        if not 0 < self.stream_stall_timeout_s <= 3600:
            raise ValueError(
                f"stream_stall_timeout_s is {self.stream_stall_timeout_s}; expected (0, 3600] s"
            )

    def _check_root_path(self) -> None:
        path = self.root_path
        if not isinstance(path, str) or len(path) > MAX_ROOT_PATH_CHARS or (
            path and (not path.startswith("/") or path.endswith("/") or "?" in path)
        ):
            raise ValueError(
                f"root_path is {path!r}; expected empty or a path such as /llm (a leading "
                f"slash, no trailing one, at most {MAX_ROOT_PATH_CHARS} characters)"
            )

    def _check_tls_files(self) -> None:
        files = {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile}
        given_names = [name for name, value in files.items() if value]
        if len(given_names) == 1:
            missing = "--ssl-certfile" if given_names == ["ssl_keyfile"] else "--ssl-keyfile"
            raise ValueError(f"{given_names[0]} is given without {missing}; TLS needs both")
        for name in given_names:
            if not Path(files[name]).is_file():  # type: ignore[arg-type]
                raise ValueError(f"{name} is {files[name]!r}, which is not a file")
        if given_names:
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
                    self.ssl_certfile, self.ssl_keyfile  # type: ignore[arg-type]
                )
            except (ssl.SSLError, OSError) as error:
                raise ValueError(
                    f"ssl_certfile {self.ssl_certfile!r} and ssl_keyfile {self.ssl_keyfile!r} "
                    f"do not load as a certificate chain and its key: {error}"
                ) from None

    @property
    def tls(self) -> bool:
        """Whether the router serves HTTPS."""
        return bool(self.ssl_keyfile and self.ssl_certfile)

    @property
    def placement(self) -> PlacementSettings:
        return PlacementSettings(
            DisaggPolicy(self.disagg_policy), self.local_prefill_tokens,
            self.local_prefill_queue_delay_s,
        )

    @property
    def model_name(self) -> str:
        """The name clients must send as `model` (defaults to the model path as given)."""
        return self.served_model_name or str(self.model_path)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may send as `model`: `model_name` and the aliases."""
        return (self.model_name, *self.served_model_aliases)
