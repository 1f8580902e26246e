"""What one router app owns: settings, tokenizer and its worker threads, metrics and the stats
log, admission queue and node client, built by `create_app` (router/api/app.py) and reachable from
every handler as `request.app.state.router`; nothing of it is module-global, so two apps in
one process are independent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from pdserve.router.api.logprobs import LogprobFormatter
from pdserve.router.api.prompt_chars import max_chars_per_token
from pdserve.router.api.unsupported import UnknownFieldLog
from pdserve.router.api.validation import KVCapacity, Limits
from pdserve.router.cluster.admission import AdmissionQueue
from pdserve.router.cluster.node_client import NodeClient
from pdserve.router.cluster.node_drain import NodeDrains
from pdserve.router.cluster.node_registry import NodeState
from pdserve.router.cluster.stats_log import StatsLog
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError, invalid
from pdserve.router.metrics import RouterMetrics
from pdserve.text.tokenizer import load_tokenizer
from pdserve.wire.package_version import package_version
from pdserve.wire.roles import Role

# Threads that tokenize and apply chat templates (HF tokenizers release the GIL while they
# encode); the characters of a prompt are bounded before it gets there.
NUM_TOKENIZER_THREADS = 4

Result = TypeVar("Result")


class WorkerThreads:
    """A few threads for the blocking work of a request (chat templates, tokenizing), so the
    event loop keeps serving every other request and stream meanwhile. Started on first use;
    `shutdown()` (at the app's shutdown) stops them, and a later use starts new ones."""

    def __init__(self, num_threads: int, name: str) -> None:
        self.num_threads = num_threads
        self.name = name
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., Result], *args: Any) -> Result:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.num_threads, thread_name_prefix=self.name)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class RouterState:
    """Everything one app owns; reachable as `app.state.router` (tests inject NodeStats
    through `app.state.router.client.record_stats`)."""

    def __init__(self, config: RouterConfig, tokenizer: Any = None) -> None:
        self.config = config
        self.tokenizer = (
            tokenizer
            if tokenizer is not None
            else load_tokenizer(
                Path(config.tokenizer_path or config.model_path), config.chat_template
            )
        )
        self.metrics = RouterMetrics(config.model_name, config.metrics_prefix)
        self.stats_log = StatsLog(config.stats_log_interval_s) if config.log_stats else None
        self.admission = AdmissionQueue(config, self.metrics.registry)
        self.client = NodeClient(
            config.node_addresses,
            config.listen_address,
            config.node_timeout_s,
            on_stats=self._on_stats,
            on_liveness=self._on_liveness,
            on_retry=self.metrics.request_retries.inc,
            cluster_auth=config.cluster_auth,
            max_queue_delay_s=config.max_queue_delay_s,
            placement=config.placement,
            registry=self.metrics.registry,
        )
        self.drains = NodeDrains(self.client, self.metrics.forget_node)
        # The admin routes' bearer token (router/api/admin.py); None: no cluster secret.
        self.admin_token = config.cluster_auth.admin_token()
        self.formatter = LogprobFormatter(self.tokenizer)
        self.tokenizer_threads = WorkerThreads(NUM_TOKENIZER_THREADS, "router-tokenize")
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)
        self.unknown_fields = UnknownFieldLog()
        self.created = int(time.time())
        self.version = package_version()  # GET /version
        self.draining = False  # set on SIGTERM (router/api/drain.py): new requests get 503

    def _on_stats(self, node: NodeState) -> None:
        name = node.node_id or node.address
        self.metrics.observe_node(name, node.stats)
        if self.stats_log is not None:
            self.stats_log.observe(name, node.stats)

    def _on_liveness(self, node: NodeState) -> None:
        name = node.node_id or node.address
        self.metrics.observe_liveness(name, node.role or "", node.up)
        if self.stats_log is not None and not node.up:
            self.stats_log.forget(name)

    def limits(self) -> tuple[int, int]:
        node = self.client.live_node()
        if node is None:
            raise APIError(503, "No inference node is available; try again later.")
        identity = node.stats.identity
        return identity.max_model_len, identity.vocab_size

    def limits_now(self) -> Limits:
        """`limits()` read now, on the event loop (it reads the node registry), as a function
        that gives the same answer, or raises the same 503, later and from any thread."""
        try:
            known = self.limits()
        except APIError as error:
            no_node = error

            def unavailable() -> tuple[int, int]:
                raise no_node

            return unavailable
        return lambda: known

    def check_prompt_chars(self, num_chars: int, limits: Limits, param: str) -> None:
        """400 for a prompt of more characters than the model's context can hold as tokens,
        decided without tokenizing it. Skipped when the tokenizer gives no bound per token,
        or when no node is alive (the request's plan answers that)."""
        if self.max_chars_per_token is None:
            return
        try:
            max_model_len, _ = limits()
        except APIError:
            return
        max_chars = max_model_len * self.max_chars_per_token
        if num_chars > max_chars:
            raise invalid(
                f"This model's maximum context length is {max_model_len:,} tokens. However, "
                f"'{param}' has {num_chars:,} characters of text, more than {max_model_len:,} "
                f"tokens can hold (a token of this model stands for at most "
                f"{self.max_chars_per_token} characters). Please reduce the length of the "
                f"{param}.",
                param,
            )

    def kv_capacity(self) -> KVCapacity:
        """The largest KV caches (in blocks) of the live nodes that would serve a request."""
        registry = self.client.registry
        prefill = registry.live(Role.PREFILL)
        serving = registry.live(Role.DECODE) if prefill else []
        if not serving:
            serving, prefill = registry.live(Role.COLOCATED), []
        stats = [n.stats for n in (*serving, *prefill)]
        return KVCapacity(
            block_size=max((s.identity.block_size for s in stats), default=0),
            serving_blocks=max((n.stats.kv.num_total_blocks for n in serving), default=0),
            prefill_blocks=max((n.stats.kv.num_total_blocks for n in prefill), default=None),
        )
