"""`LauncherSettings`: `pdserve serve`'s own options, checked once.

How the deployment is laid out (node counts, transport, threads), where it listens, how it is
run (restarts, output), and which model it serves. Each field's `option` metadata gives its flag
and help; the serve parser is generated from it (commands/serve_flags.py) with the fields'
defaults, so the launcher reads them from its arguments as given or defaulted. The options the
launcher hands to its children are EngineConfig's, NodeConfig's, RouterConfig's and
LogSettings' (commands/launcher.py, commands/router_plan.py); those named here are its own.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.wire.config_flags import option

GENERATION_CONFIG_DEFAULT = "vllm"
# auto: commands/launcher.py; the others are kvtransfer's TRANSPORT_NAMES (a test checks), kept
# here as names because the launcher's flags load before any torch import.
KV_TRANSPORTS = ("auto", "shm", "cuda_ipc", "zmq", "mooncake")


@dataclass(frozen=True)
class LauncherSettings:
    """Each field's `option` metadata gives its flag and help (wire/config_flags.py); groups
    in `pdserve serve --help` follow `group`."""

    colocated: bool = option(
        False, flag="--colocated", switch=True, group="deployment",
        help="prefill and decode in one node",
    )
    prefill: int = option(
        1, flag="--prefill", metavar="N", group="deployment", help="prefill nodes"
    )
    decode: int = option(
        1, flag="--decode", metavar="M", group="deployment", help="decode nodes"
    )
    threads_per_node: int | None = option(
        None, flag="--threads-per-node", metavar="N", group="deployment",
        help="CPU threads of each node on a CPU host, nothing borrowed (default: a disjoint "
        "equal share of the cores, the only decode node borrowing every core while none of its "
        "prompts is being prefilled: commands/node_threads.py)",
    )
    router_listen: str | None = option(
        None, flag="--router-listen", metavar="ADDR", group="deployment",
        help="the router's ZeroMQ address for node messages (default: a free loopback port)",
    )
    kv_transport: str = option(
        "auto", flag="--kv-transport", choices=KV_TRANSPORTS, group="deployment",
        help="how KV moves from prefill to decode nodes (auto: cuda_ipc on GPUs, else shm; "
        "with a --router-listen other hosts reach, mooncake if installed, else zmq)",
    )
    ray: str | None = option(
        None, flag="--ray", nargs="?", const="", metavar="ADDRESS", group="deployment",
        help="run the router and every node as actors of a Ray cluster, which places them on "
        "its hosts (needs pdserve[ray]): ADDRESS is the cluster's (or auto); without it, the "
        "one $RAY_ADDRESS names, else a cluster started on this host for the run "
        "(docs/many_hosts.md)",
    )
    host: str = option(
        "127.0.0.1", flag="--host", group="deployment", help="HTTP bind address (the router's)"
    )
    port: int = option(8000, flag="--port", group="deployment", help="HTTP port")
    verbose: bool = option(
        False, flag="--verbose", switch=True, group="deployment",
        help="every process writes to this terminal from the start (default: each to its "
        "log file, echoed here once the deployment is ready)",
    )
    restart_nodes: bool = option(
        True, flag="--restart-nodes", group="deployment",
        help="restart a node process that exits",
    )
    model: str | None = option(None, flag="--model", group="model", help="MODEL, as a flag")
    served_model_name: Sequence[str] | None = option(
        None, flag="--served-model-name", nargs="+", metavar="NAME", group="model",
        help="names clients may send as `model`; /v1/models lists the first (default: the "
        "folder's name, or the Hub id)",
    )
    tokenizer: str | None = option(
        None, flag="--tokenizer", metavar="PATH_OR_ID", group="model",
        help="a folder or Hub id whose tokenizer (tokenizer.json, tokenizer_config.json, chat "
        "template) the router and nodes read instead of the model's; the weights stay MODEL's",
    )
    revision: str | None = option(
        None, flag="--revision", metavar="REV", group="model",
        help="a Hub id's branch, tag or commit (default: main)",
    )
    download_dir: str | None = option(
        None, flag="--download-dir", metavar="DIR", group="model",
        help="the Hugging Face cache a Hub id is read from and fetched into (default: "
        "$HF_HUB_CACHE, else $HF_HOME/hub)",
    )
    generation_config: str = option(
        GENERATION_CONFIG_DEFAULT, flag="--generation-config", metavar="vllm", group="model",
        help="vllm only: a field a request leaves out takes the API's default, not "
        "generation_config.json's (which gives the stop tokens)",
    )
    trust_remote_code: bool = option(
        False, flag="--trust-remote-code", switch=True, group="model",
        help="accepted for vLLM's command lines; pdserve never runs a model's own code",
    )

    def __post_init__(self) -> None:
        if self.generation_config != GENERATION_CONFIG_DEFAULT:
            raise ValueError(
                f"--generation-config {self.generation_config}: pdserve takes no default "
                "sampling parameters from generation_config.json; a field a request leaves out "
                "takes the API's default (vLLM's --generation-config vllm)"
            )
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("--prefill and --decode need at least one node each")
        if self.threads_per_node is not None and self.threads_per_node < 1:
            raise ValueError(f"--threads-per-node {self.threads_per_node}: expected 1 or more")
        if self.ray is not None and importlib.util.find_spec("ray") is None:
            raise ValueError("--ray needs Ray, which is not installed: pip install 'pdserve[ray]'")
