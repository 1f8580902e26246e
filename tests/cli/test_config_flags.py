"""One source of configuration: every operator option of EngineConfig, NodeConfig and
RouterConfig, given a non-default value on `pdserve serve`'s command line, reaches the config
each planned node, and the planned router, builds, field by field; and a field added with flag
metadata appears on every command line without a hand-written flag (wire/config_flags.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import pdserve.engine.config as engine_config_module
import pdserve.node.cli as node_cli
import pdserve.router.__main__ as router_main
import pdserve.router.config as router_config
from pdserve.commands import router_plan
from pdserve.commands.cli import build_parser
from pdserve.commands.launcher import plan_nodes
from pdserve.commands.launcher_settings import LauncherSettings
from pdserve.commands.model_source import ServedModel
from pdserve.engine.config import EngineConfig
from pdserve.node.config import CONFIG_ENV, NodeConfig
from pdserve.router.config import RouterConfig
from pdserve.wire.child_command import python_module_command
from pdserve.wire.cluster_auth import ClusterAuth
from pdserve.wire.config_flags import build, option, options
from pdserve.wire.roles import Role
from tests.cli.test_serve_flags import TEMPLATE, child_configs, planned_router, serve_args
from tests.tls_certificate import self_signed_certificate

# field -> (the flags `pdserve serve` gets, the field value each node must build): a new
# option fails test_every_option_has_a_case until it gets one here.
ENGINE_CASES = {
    "dtype": (["--dtype", "float16"], "float16"),
    "kv_cache_dtype": (["--kv-cache-dtype", "fp8"], "fp8_e4m3"),  # vLLM's alias, normalized
    "quantization": (["-q", "int8"], "int8"),  # vLLM's short spelling
    "load_format": (["--load-format", "dummy"], "dummy"),
    "block_size": (["--block-size", "32"], 32),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "300"], 300),
    "max_num_seqs": (["--max-num-seqs", "7"], 7),
    "max_model_len": (["--max-model-len", "512"], 512),
    "kv_cache_memory": (["--kv-cache-memory", "1048576"], 1 << 20),
    "num_kv_blocks": (["--num-kv-blocks", "40"], 40),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "tensor_parallel_size": (["--tensor-parallel-size", "2"], 2),
    "attention_backend": (["--attention-backend", "triton"], "triton"),
    "cuda_graphs": (["--enforce-eager"], False),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "prefix_cache_min_blocks": (["--prefix-cache-min-blocks", "3"], 3),
    "seed": (["--seed", "42"], 42),
    "preemption_mode": (["--preemption-mode", "swap"], "swap"),
    "swap_space": (["--swap-space", "0.5"], 1 << 29),  # GiB on the command line, bytes here
    "admission": (["--admission", "predicted"], "predicted"),
    "admission_quantile": (["--admission-quantile", "0.5"], 0.5),
    "priority_aging_s": (["--priority-aging-seconds", "2.5"], 2.5),
}
NODE_CASES = {
    "heartbeat_interval": (["--heartbeat-interval", "0.25"], 0.25),
    "transfer_timeout_s": (["--transfer-timeout", "7"], 7.0),
    "kv_layers_per_write": (["--kv-layers-per-write", "3"], 3),
    "queue_timeout_s": (["--queue-timeout", "9"], 9.0),
}

ROUTER_CASES = {
    "chat_template": (["--chat-template", TEMPLATE], TEMPLATE),  # the template's text
    "api_key": (["--api-key", "key-5678"], "key-5678"),
    "max_n": (["--max-n", "4"], 4),
    "max_queued_requests": (["--max-queued-requests", "9"], 9),
    "max_queued_tokens": (["--max-queued-tokens", "999"], 999),
    "max_queue_delay_s": (["--max-queue-delay", "2.5"], 2.5),
    "disagg_policy": (["--disagg-policy", "auto"], "auto"),
    "reasoning_parser": (["--reasoning-parser", "qwen3"], "qwen3"),
    "metrics_prefix": (["--metrics-prefix", "vllm"], "vllm"),
    "max_logprobs": (["--max-logprobs", "5"], 5),
    "default_chat_template_kwargs": (
        ["--default-chat-template-kwargs", "{\"enable_thinking\": false}"],
        {"enable_thinking": False},
    ),
    "local_prefill_tokens": (["--local-prefill-tokens", "64"], 64),
    "local_prefill_queue_delay_s": (["--local-prefill-queue-delay", "0.5"], 0.5),
    "stream_stall_timeout_s": (["--stream-stall-timeout", "4"], 4.0),
    "max_stream_buffer_tokens": (["--max-stream-buffer-tokens", "77"], 77),
    "node_timeout_s": (["--node-timeout", "3"], 3.0),
    "drain_timeout_s": (["--drain-timeout", "5"], 5.0),
    "allow_client_priority": (["--allow-client-priority"], True),
    "log_requests": (["--disable-log-requests"], False),
    "log_stats": (["--disable-log-stats"], False),
    "api_key_guards_every_route": (["--api-key-guards-every-route"], True),
    "allowed_origins": (["--allowed-origins", '["https://a.example"]'], ["https://a.example"]),
    "allowed_methods": (["--allowed-methods", '["GET", "POST"]'], ["GET", "POST"]),
    "allowed_headers": (["--allowed-headers", '["authorization"]'], ["authorization"]),
    "allow_credentials": (["--allow-credentials"], True),
    "root_path": (["--root-path", "/llm"], "/llm"),
}
# Options whose values must name real files: given by the test that makes them.
TLS_OPTIONS = {"ssl_keyfile", "ssl_certfile"}


def serve_options(cls: type) -> set[str]:
    return {f.name for f in options(cls) if not f.metadata.get("launcher_sets")}


def test_every_option_has_a_case():
    assert serve_options(EngineConfig) == set(ENGINE_CASES)
    assert serve_options(NodeConfig) == set(NODE_CASES)
    assert serve_options(RouterConfig) == set(ROUTER_CASES) | TLS_OPTIONS


@pytest.mark.parametrize("layout", [["--kv-transport", "shm"], ["--colocated"]])
def test_every_serve_option_reaches_every_planned_node_field_by_field(layout):
    cases = {**ENGINE_CASES, **NODE_CASES}
    flags = [flag for argv, _ in cases.values() for flag in argv]
    args = serve_args(["/models/tiny", *layout, "--threads-per-node", "2", *flags])
    plans = plan_nodes(args, "/models/tiny", "tcp://127.0.0.1:27001")
    assert len(plans) == (1 if "--colocated" in layout else 2)
    for plan in plans:
        engine, node, _log = child_configs(plan)
        want_engine = {name: value for name, (_, value) in ENGINE_CASES.items()}
        expected_engine = EngineConfig(model="/models/tiny", num_threads=2, **want_engine)
        for f in dataclasses.fields(EngineConfig):
            assert getattr(engine, f.name) == getattr(expected_engine, f.name), f.name
        want_node = {name: value for name, (_, value) in NODE_CASES.items()}
        expected_node = NodeConfig(
            node_id=plan.name, listen_address=plan.address, router_address="tcp://127.0.0.1:27001",
            kv_transport="shm", **want_node,
        )
        for f in dataclasses.fields(NodeConfig):
            assert getattr(node, f.name) == getattr(expected_node, f.name), f.name
        # Handed over as data, in field units, and not on the command line.
        assert json.loads(plan.env[CONFIG_ENV])["engine"]["swap_space"] == 1 << 29
        assert plan.argv == [*python_module_command("pdserve.node"), Role(plan.argv[-1])]


def test_flags_given_to_a_node_override_its_launcher_config():
    plan = plan_nodes(serve_args(["--colocated", "--max-num-seqs", "7"]), "/m", "tcp://127.0.0.1:1")[0]
    parser = node_cli.role_parser(Role.COLOCATED)
    engine, config, _ = node_cli.configs(parser.parse_args(["--max-num-seqs", "9"]), plan.env)
    assert (engine.max_num_seqs, engine.model, config.node_id) == (9, "/m", plan.name)


def test_a_node_started_directly_needs_its_addresses():
    parser = node_cli.role_parser(Role.COLOCATED)
    with pytest.raises(ValueError, match="--node-id, --listen, --router are required"):
        node_cli.configs(parser.parse_args([]), {})
    with pytest.raises(ValueError, match="no option bogus"):
        node_cli.configs(parser.parse_args([]), {CONFIG_ENV: '{"engine": {"bogus": 1}}'})


def test_a_field_with_flag_metadata_appears_on_every_command_line(monkeypatch, capsys):
    @dataclasses.dataclass
    class WithNewOption(EngineConfig):
        new_knob: int = option(3, flag="--new-knob", help="an option added in one place")

    monkeypatch.setattr(engine_config_module, "EngineConfig", WithNewOption)
    monkeypatch.setattr(node_cli, "EngineConfig", WithNewOption)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--new-knob NEW_KNOB" in capsys.readouterr().out
    assert "--new-knob" in node_cli.node_parser("node", "").format_help()
    args = serve_args(["--colocated", "--new-knob", "5"])
    plan = plan_nodes(args, "/m", "tcp://127.0.0.1:1")[0]
    engine_built = child_configs(plan)[0]
    assert isinstance(engine_built, WithNewOption) and engine_built.new_knob == 5
    assert build(WithNewOption).new_knob == 3


def test_every_router_option_given_on_serve_reaches_the_routers_config_field_by_field(tmp_path):
    key, cert = self_signed_certificate(tmp_path)
    cases = {
        **ROUTER_CASES,
        "ssl_keyfile": (["--ssl-keyfile", str(key)], str(key)),
        "ssl_certfile": (["--ssl-certfile", str(cert)], str(cert)),
    }
    flags = [flag for argv, _ in cases.values() for flag in argv]
    args = serve_args(["/models/tiny", *flags])
    served = ServedModel(Path("/models/tiny"), ("tiny", "tiny-alias"))
    plan, (config, _log) = planned_router(args, served)
    expected = RouterConfig(
        model_path="/models/tiny", served_model_name="tiny", served_model_aliases=("tiny-alias",),
        listen_address="tcp://127.0.0.1:26992", node_addresses=["node-0=tcp://127.0.0.1:26991"],
        cluster_auth=ClusterAuth.from_secret("s" * 32),
        **{name: value for name, (_, value) in cases.items()},
    )
    for f in dataclasses.fields(RouterConfig):
        assert getattr(config, f.name) == getattr(expected, f.name), f.name
    assert plan.argv == python_module_command("pdserve.router")  # nothing on the command line


def test_the_tokenizer_folder_reaches_the_router_and_every_node():
    """`--tokenizer` is the launcher's: it resolves the folder (commands/model_source.py) and
    hands it to the router's RouterConfig and to each node's EngineConfig."""
    args = serve_args(["/models/tiny", "--tokenizer", "/tokenizers/other"])
    assert args.tokenizer == "/tokenizers/other"
    served = ServedModel(Path("/models/tiny"), ("tiny",), Path("/tokenizers/other"))
    _, (config, _log) = planned_router(args, served)
    assert (config.model_path, config.tokenizer_path) == ("/models/tiny", "/tokenizers/other")
    plans = plan_nodes(args, "/models/tiny", "tcp://127.0.0.1:27001", "/tokenizers/other")
    for plan in plans:
        engine = child_configs(plan)[0]
        assert (engine.model, engine.tokenizer) == ("/models/tiny", "/tokenizers/other")
    assert planned_router(serve_args([]))[1][0].tokenizer_path is None


def test_a_router_started_directly_needs_its_model_nodes_and_address(capsys):
    with pytest.raises(SystemExit):
        router_main.parse_args([], environ={})
    assert "--model, --node, --listen are required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        router_main.parse_args([], environ={router_config.CONFIG_ENV: '{"router": {"x": 1}}'})
    assert "RouterConfig has no option x" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        router_main.parse_args(
            ["--model", "m", "--node", "tcp://127.0.0.1:1", "--listen", "tcp://127.0.0.1:2",
             "--max-n", "999"], environ={},
        )
    assert "--max-n is 999; expected 1 to" in capsys.readouterr().err


def test_a_router_field_with_flag_metadata_appears_on_both_command_lines(monkeypatch, capsys):
    @dataclasses.dataclass
    class WithNewOption(RouterConfig):
        new_router_knob: int = option(3, flag="--new-router-knob", help="added in one place")

    for module in (router_config, router_main, router_plan):
        monkeypatch.setattr(module, "RouterConfig", WithNewOption)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--new-router-knob NEW_ROUTER_KNOB" in capsys.readouterr().out
    assert "--new-router-knob" in router_main.build_parser().format_help()
    _, (config, _log) = planned_router(serve_args(["--new-router-knob", "5"]))
    assert isinstance(config, WithNewOption) and config.new_router_knob == 5
    assert planned_router(serve_args([]))[1][0].new_router_knob == 3


def test_the_router_flag_table_names_every_generated_router_flag():
    from pdserve.wire.log_format import LogSettings

    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    table = text[text.index("### Router flags"):text.index("## Containers")]
    flags = [f.metadata["flag"] for cls in (RouterConfig, LogSettings) for f in options(cls)]
    assert [flag for flag in flags if f"`{flag}" not in table] == []


def test_the_serve_parser_takes_the_launchers_own_defaults_from_launcher_settings():
    args = serve_args([])
    for f in options(LauncherSettings):
        assert getattr(args, f.name) == f.default, f.name
    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    serve_tables = text[text.index("Deployment (the launcher's"):text.index("### GPU placement")]
    assert [f.metadata["flag"] for f in options(LauncherSettings)
            if f"`{f.metadata['flag']}" not in serve_tables] == []
    with pytest.raises(ValueError, match="--prefill and --decode need at least one node"):
        serve_args(["--decode", "0"])


@pytest.mark.parametrize("layers", [0, -1, 4097, True, 2.5])
def test_kv_layers_per_write_outside_its_bounds_is_refused_by_name(layers):
    with pytest.raises(ValueError, match=f"kv_layers_per_write is {layers!r}; expected 1-4096"):
        NodeConfig(
            node_id="p", listen_address="tcp://127.0.0.1:1", router_address="tcp://127.0.0.1:2",
            kv_layers_per_write=layers,
        )
