"""`pdserve serve`'s vLLM spellings reach the processes it starts: each node's argv and
environment, as the launcher plans them, parsed by the node's own parser into the node's
EngineConfig, and the router's parsed by the router's own parser into its RouterConfig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.commands.cli import build_parser, main
from pdserve.commands.launcher import plan_nodes
from pdserve.commands.model_source import ServedModel, resolve_served_model
from pdserve.commands.role_changer import plan_in_role
from pdserve.commands.router_plan import plan_router
from pdserve.commands.serve_flags import check_serve_flags
from pdserve.node.cli import configs, role_parser
from pdserve.router.__main__ import parse_args as parse_router_args
from pdserve.router.config import API_KEY_ENV
from pdserve.router.config import CONFIG_ENV as ROUTER_CONFIG_ENV
from pdserve.wire.child_command import python_module_command
from pdserve.wire.cluster_auth import SECRET_ENV
from pdserve.wire.log_format import LogSettings
from pdserve.wire.roles import Role

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def serve_args(flags: list[str]):
    args = build_parser().parse_args(["serve", *flags])
    check_serve_flags(args)
    return args


def child_configs(plan):
    """(EngineConfig, NodeConfig, LogSettings) as the planned node process builds them: its
    argv parsed by its own parser, its environment's PDSERVE_NODE_CONFIG under it."""
    start = len(python_module_command("pdserve.node"))
    assert plan.argv[:start] == python_module_command("pdserve.node")
    role, node_argv = Role(plan.argv[start]), plan.argv[start + 1:]
    return configs(role_parser(role).parse_args(node_argv), plan.env)


def planned_router(args, served: ServedModel | None = None):
    """(RouterPlan, (RouterConfig, LogSettings)): the router the launcher plans, and what that
    process builds from its argv and environment alone (nothing of this process's)."""
    served = served or ServedModel(Path("/m/x"), ("x",))
    plan = plan_router(
        args, served, "tcp://127.0.0.1:26992", ["node-0=tcp://127.0.0.1:26991"], "s" * 32,
    )
    assert plan.argv == python_module_command("pdserve.router")
    return plan, parse_router_args([], environ=plan.env)


def node_engine_configs(args, model: str = "/models/tiny"):
    return [
        child_configs(plan)[0] for plan in plan_nodes(args, model, "tcp://127.0.0.1:26990")
    ]


@pytest.mark.parametrize("layout", [[], ["--colocated"]])
def test_vllm_engine_flags_reach_every_node_the_launcher_plans(layout):
    args = serve_args([
        "/models/tiny", *layout, "--kv-transport", "shm", "--threads-per-node", "1",
        "--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "7",
        "--max-num-batched-tokens", "300", "--no-enable-prefix-caching",
        "--gpu-memory-utilization", "0.5", "--enforce-eager", "--load-format", "dummy",
        "--seed", "42", "--trust-remote-code", "--tensor-parallel-size", "1",
    ])
    configs = node_engine_configs(args)
    assert len(configs) == (1 if layout else 2)
    for config in configs:
        assert config.model == "/models/tiny"
        assert (config.dtype, config.max_model_len, config.max_num_seqs) == ("bfloat16", 512, 7)
        assert config.max_num_batched_tokens == 300
        assert config.enable_prefix_caching is False
        assert config.gpu_memory_utilization == 0.5
        assert config.cuda_graphs is False
        assert (config.load_format, config.seed) == ("dummy", 42)


def test_a_node_the_planner_turns_keeps_its_slot_and_settings_in_its_new_role():
    """The slot of a decode node, planned as a prefill node (commands/role_changer.py), parsed
    by the node's own parser: its role, id and address change, its engine settings do not, and
    with the planner on no node borrows threads."""
    args = serve_args([
        "/models/tiny", "--prefill", "2", "--planner", "load", "--kv-transport", "shm",
        "--max-num-seqs", "7",
    ])
    plans = plan_nodes(args, "/models/tiny", "tcp://127.0.0.1:26990")
    assert all("threads_while_prefill_idle" not in p.config["node"] for p in plans)
    decode = plans[-1]
    turned = plan_in_role(decode, Role.PREFILL, "prefill-2.8000", "tcp://127.0.0.1:26999")
    assert turned.argv[-1] == "prefill" and turned.name == "prefill-2.8000"
    engine, node, _ = child_configs(turned)
    old_engine, old_node, _ = child_configs(decode)
    assert (node.node_id, node.listen_address) == ("prefill-2.8000", "tcp://127.0.0.1:26999")
    assert (node.router_address, node.kv_transport) == (old_node.router_address, "shm")
    assert engine == old_engine and engine.max_num_seqs == 7


def test_nodes_keep_the_engine_defaults_when_no_flag_is_given():
    defaults = node_engine_configs(serve_args(["--kv-transport", "shm"]))[0]
    assert (defaults.dtype, defaults.seed, defaults.max_num_seqs) == ("auto", 0, 256)
    assert defaults.enable_prefix_caching is True


def test_model_flag_is_an_alias_of_the_positional_model():
    assert serve_args(["--model", "/models/a"]).model == "/models/a"
    assert serve_args(["/models/a"]).model == "/models/a"
    assert serve_args([]).model is None


def test_served_model_names_and_chat_template_reach_the_router(tmp_path):
    template_file = tmp_path / "template.jinja"
    template_file.write_text(TEMPLATE)
    for template in (TEMPLATE, str(template_file)):
        args = serve_args(["--served-model-name", "tiny", "tiny-alias", "--chat-template", template])
        served = resolve_served_model("/models/tiny", args.served_model_name)
        _, (config, _) = planned_router(args, served)
        assert str(config.model_path) == "/models/tiny"
        assert config.model_name == "tiny"
        assert config.model_names == ("tiny", "tiny-alias")
        assert config.chat_template == TEMPLATE


def test_served_name_defaults_to_the_folder_name_not_the_path(tmp_path):
    served = resolve_served_model(str(tmp_path / "SmolLM2-135M-Instruct"))
    assert served.names == ("SmolLM2-135M-Instruct",)
    assert served.folder == tmp_path / "SmolLM2-135M-Instruct"
    assert resolve_served_model("relative/folder/", None).names == ("folder",)
    _, (config, _) = planned_router(serve_args([]), ServedModel(Path("/m/x"), ("x",)))
    assert (config.model_path, config.model_names) == ("/m/x", ("x",))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-tp", "0"], "--tensor-parallel-size must be >= 1, got 0"),
        (["--generation-config", "auto"], "--generation-config auto: pdserve takes no default"),
        (["--chat-template", "no/such/template.jinja"], "neither a file nor a Jinja template"),
        (["--chat-template", "{% for %}"], "the chat template does not parse"),
        (["--dtype", "int8"], "argument --dtype: invalid choice"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["/models/a", "--model", "/models/b"], "MODEL '/models/a' and --model '/models/b'"),
        (["--planner", "slo", "--decode", "2"], "--planner slo needs its targets"),
        (["--planner", "slo", "--planner-slo", "ttft=2"], "--planner-slo lacks itl"),
        (["--planner", "load"], "with --prefill 1 --decode 1 it could never act"),
        (["--planner", "load", "--colocated"], "a --colocated deployment has neither"),
        (
            ["--planner", "load", "--decode", "2", "--planner-kv-usage-high", "2"],
            "--planner-kv-usage-high is 2.0; expected 0 to 1",
        ),
        (["--planner", "load", "--decode", "2", "--host", "10.0.0.1"], "--host is 10.0.0.1"),
        (["--default-chat-template-kwargs", '{"messages": []}'],
         "'--default-chat-template-kwargs.messages' is set by the server itself"),
        (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
    ],
)
def test_bad_serve_flags_print_pdserve_serve_usage(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pdserve serve "), err
    assert message in err


def test_router_logging_flags_reach_the_router():
    args = serve_args(["--log-format", "json", "--uvicorn-log-level", "info",
                       "--disable-log-requests", "--log-level", "WARNING"])
    _, (config, log) = planned_router(args)
    assert (log.level, log.log_format, log.uvicorn_level) == ("warning", "json", "info")
    assert config.log_requests is False and config.log_stats is True
    defaults, (config, log) = planned_router(serve_args([]))
    assert config.log_requests is True and log == LogSettings()
    assert json.loads(defaults.env[ROUTER_CONFIG_ENV])["log"] == {}


def test_the_router_gets_its_settings_as_data_and_its_secrets_in_its_environment_alone():
    plan, (config, _) = planned_router(serve_args(["--api-key", "key-1234", "--max-n", "4"]))
    assert plan.argv == python_module_command("pdserve.router")
    assert (config.api_key, config.max_n) == ("key-1234", 4)
    assert config.cluster_auth.enabled
    assert plan.env[API_KEY_ENV] == "key-1234" and plan.env[SECRET_ENV] == "s" * 32
    handed = json.loads(plan.env[ROUTER_CONFIG_ENV])
    assert "key-1234" not in plan.env[ROUTER_CONFIG_ENV] and "s" * 32 not in json.dumps(handed)
    assert set(handed["router"]) >= {"model_path", "listen_address", "node_addresses", "max_n"}
    # Without --api-key the router reads $PDSERVE_API_KEY, as `python -m pdserve.router` does.
    plan, _ = planned_router(serve_args([]))
    assert API_KEY_ENV not in plan.env


def test_the_node_timeout_holds_on_a_loaded_host_unless_given():
    """30 s of silence, not two missed heartbeats: a dead node is caught by its connection."""
    assert planned_router(serve_args([]))[1][0].node_timeout_s == 30.0
    given = serve_args(["--node-timeout", "3"])
    assert planned_router(given)[1][0].node_timeout_s == 3.0


def test_log_format_reaches_every_node():
    for plan in plan_nodes(serve_args(["--log-format", "json", "--log-level", "debug",
                                       "--kv-transport", "shm"]), "/m", "tcp://127.0.0.1:1"):
        log = child_configs(plan)[2]
        assert (log.log_format, log.level) == ("json", "debug")


def test_a_chat_template_given_replaces_the_model_folders(tiny_llama_dir):
    from pdserve.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama_dir, chat_template=TEMPLATE)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids) == "<user>hi<assistant>"


def test_tensor_parallel_size_reaches_prefill_and_decode_nodes_on_a_cpu_host():
    args = serve_args(["/models/tiny", "-tp", "2", "--threads-per-node", "2"])
    configs = node_engine_configs(args)
    assert [(c.tensor_parallel_size, c.num_threads) for c in configs] == [(2, 2), (2, 2)]


def test_tensor_parallel_size_reaches_the_colocated_node_with_its_threads():
    args = serve_args(["/models/tiny", "--colocated", "-tp", "2", "--threads-per-node", "2"])
    (config,) = node_engine_configs(args)
    assert (config.tensor_parallel_size, config.num_threads) == (2, 2)  # 1 thread per rank


def test_vllms_http_flags_reach_the_router(tmp_path):
    args = serve_args([
        "--allowed-origins", '["https://a.example"]', "--allowed-methods", '["POST"]',
        "--allowed-headers", '["authorization"]', "--allow-credentials", "--root-path", "/llm",
        "--api-key-guards-every-route", "--enable-log-requests",
    ])
    _, (config, _) = planned_router(args)
    assert config.allowed_origins == ["https://a.example"]
    assert (config.allowed_methods, config.allowed_headers) == (["POST"], ["authorization"])
    assert config.allow_credentials and config.api_key_guards_every_route
    assert config.root_path == "/llm" and config.log_requests is True


@pytest.mark.parametrize(("flags", "message"), [
    (["--enable-log-requests", "--disable-log-requests"], "not allowed with argument"),
    (["--ssl-keyfile", "/nonexistent.key"], "--ssl-keyfile is given without --ssl-certfile"),
    (["--root-path", "llm/"], "--root-path is 'llm/'"),
    (["--allowed-origins", "*"], "--allowed-origins is '*'; expected a JSON list"),
])
def test_serve_refuses_inconsistent_http_flags_by_name(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
