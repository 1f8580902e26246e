"""The `pdserve` command.

  pdserve download [MODEL]    fetch (and convert) the default model or a Hub id (idempotent)
  pdserve generate PROMPT...  one-shot greedy generation, printed as it streams
  pdserve chat                interactive chat with the model's chat template
  pdserve serve [MODEL]       the OpenAI-compatible HTTP server (router + nodes)
  pdserve profile             measure one node's step times on this device (planner/)
  pdserve plan --workload F   the layout, chunk size and thresholds with the best goodput
  pdserve bench serve         load-test an OpenAI-compatible server (python -m pdserve.bench.serve)
  pdserve colocated|prefill|decode [flags]
                              one node that joins a router elsewhere (pdserve ROLE --help)
  pdserve --version           pdserve's version

Node code is imported inside each subcommand, so `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.commands.serve_flags import add_engine_flags, add_serve_flags, check_serve_flags
from pdserve.commands.workload_plan import add_profile_parser, add_workload_flags
from pdserve.wire.package_version import package_version
from pdserve.wire.roles import Role

NODE_ROLES = tuple(Role)

def _make_llm(args: argparse.Namespace):
    from pdserve.engine import LLM
    from pdserve.engine.config import EngineConfig
    from pdserve.wire.config_flags import given

    options = given(EngineConfig, args)
    return LLM(options.pop("model", None), **options)


def _params(args: argparse.Namespace):
    from pdserve.engine import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)


def _print_stream(pieces) -> str:
    """Prints text pieces as they arrive, then a newline; returns the whole text."""
    text = []
    for piece in pieces:
        text.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(text)


def cmd_download(args: argparse.Namespace) -> int:
    if args.model is None:
        from pdserve.model_store.default_model import ensure_default_model

        print(ensure_default_model())
        return 0
    from pdserve.model_store.hub import HubModelUnavailable, hub_model_folder, is_hub_id

    if not is_hub_id(args.model):
        raise ValueError(f"{args.model!r} is not a Hugging Face Hub id (org/name)")
    try:
        print(hub_model_folder(args.model, args.revision, args.download_dir))
    except HubModelUnavailable as error:
        raise ValueError(str(error)) from None
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    _print_stream(llm.stream(" ".join(args.prompt), _params(args)))
    return 0


def _chat_turn(llm, history: list[dict], params) -> str:
    return _print_stream(llm.stream(llm.tokenizer.apply_chat_template(history), params))


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _params(args)
    history: list[dict] = []
    print("pdserve chat: type a message, or an empty line to quit.", file=sys.stderr)
    while True:
        try:
            message = input("> ").strip()
        except EOFError:
            return 0
        if not message:
            return 0
        history.append({"role": "user", "content": message})
        history.append({"role": "assistant", "content": _chat_turn(llm, history, params)})


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.commands.launcher import check_cluster_settings, check_node_settings, serve
    from pdserve.commands.router_plan import check_router_settings
    from pdserve.commands.vllm_flags import NO_OPS

    try:
        check_serve_flags(args)
        check_cluster_settings(args)
        check_node_settings(args)
        check_router_settings(args)
    except ValueError as error:
        args.parser.error(str(error))
    for spelling in getattr(args, "vllm_no_ops", ()):
        print(f"pdserve: {spelling} (vLLM's) accepted: {NO_OPS[spelling].why}", file=sys.stderr)
    if args.ray is not None:
        from pdserve.commands.ray_launcher import serve_on_ray

        return serve_on_ray(args)
    return serve(args)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.workload is not None:
        from pdserve.commands.workload_plan import cmd_workload_plan

        return cmd_workload_plan(args)
    if args.model is None:
        args.parser.error("the capacity plan needs --model (or --workload for a workload plan)")
    from pdserve.commands.plan import (
        parse_bytes,
        plan_capacity,
        render_json,
        render_table,
        resolve_shape,
    )

    plan = plan_capacity(
        resolve_shape(args.model),
        args.dtype,
        parse_bytes(args.memory),
        args.reserve,
        [int(n) for n in args.seq_lens.split(",")],
        args.block_size,
        args.kv_cache_dtype,
        args.tensor_parallel_size,
    )
    print(render_json(plan) if args.json else render_table(plan))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if not args.bench_args or args.bench_args[0] != "serve":
        print("pdserve bench: expected `pdserve bench serve [flags]`", file=sys.stderr)
        return 2
    from pdserve.bench.serve import main as serve_main

    return serve_main(args.bench_args[1:], prog="pdserve bench serve")


def cmd_node(role: str, node_args: list[str]) -> int:
    """One node of `role` that joins a router elsewhere (`python -m pdserve.node ROLE` flags)."""
    from pdserve.node.__main__ import main as node_main

    return node_main([role, *node_args])


def build_parser() -> argparse.ArgumentParser:
    from pdserve.engine.config import EngineConfig
    from pdserve.wire.config_flags import add_flags

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--version", action="version", version=f"pdserve {package_version()}",
        help="print pdserve's version and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    download = sub.add_parser("download", help="fetch the default model or a Hub id")
    download.add_argument(
        "model", nargs="?", default=None, metavar="MODEL",
        help="a Hugging Face Hub id (org/name); default: the default model",
    )
    download.add_argument("--revision", default=None, help="branch, tag or commit (main)")
    download.add_argument(
        "--download-dir", default=None, metavar="DIR", help="the Hugging Face cache to fill"
    )
    download.set_defaults(run=cmd_download, parser=download)
    generate = sub.add_parser("generate", help="one-shot generation")
    generate.add_argument("prompt", nargs="+")
    add_engine_flags(generate)
    generate.set_defaults(run=cmd_generate, parser=generate)
    chat = sub.add_parser("chat", help="interactive chat")
    add_engine_flags(chat)
    chat.set_defaults(run=cmd_chat, parser=chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_flags(serve)
    serve.set_defaults(run=cmd_serve, parser=serve)
    plan = sub.add_parser(
        "plan", help="KV cache size and maximum concurrency for a model; with --workload, the "
        "layout with the best goodput per device"
    )
    plan.add_argument("--model", default=None, help="a model folder or a known name")
    plan.add_argument(
        "--dtype", default="bf16",
        help="KV and weight dtype (default bf16, what --dtype auto runs on CUDA and on CPUs with "
        "AMX-BF16 or AVX512-BF16; fp32 on other CPUs)",
    )
    plan.add_argument("--memory", default="80GiB", help="device memory, e.g. 80GiB")
    plan.add_argument("--reserve", type=float, default=0.1, help="fraction kept free")
    plan.add_argument("--seq-lens", default="1024,8192,32768", help="tokens per sequence")
    plan.add_argument("--block-size", type=int, default=16)
    add_flags(
        plan, EngineConfig, select=lambda f: f.name in ("kv_cache_dtype", "tensor_parallel_size"),
        defaults=True,
    )
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    add_workload_flags(plan)
    plan.set_defaults(run=cmd_plan, parser=plan)
    add_profile_parser(sub)
    sub.add_parser(
        "bench", help="serve: load-test any OpenAI-compatible server", add_help=False
    ).add_argument("bench_args", nargs=argparse.REMAINDER)
    for role in NODE_ROLES:
        sub.add_parser(
            role,
            help=f"one {role} node that joins a router elsewhere (its flags: pdserve {role} "
            "--help)",
            add_help=False,
        ).add_argument("node_args", nargs=argparse.REMAINDER)
    return parser


def serve_parser() -> argparse.ArgumentParser:
    """`pdserve serve`'s own parser."""
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subcommands.choices["serve"]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":  # every later flag belongs to the benchmark
        return cmd_bench(argparse.Namespace(bench_args=argv[1:]))
    if argv and argv[0] in NODE_ROLES:  # every later flag belongs to the node
        return cmd_node(argv[0], argv[1:])
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # with the subcommand's usage, not the top-level one
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.run(args)
    except ValueError as error:
        print(f"pdserve: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
