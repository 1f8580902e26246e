"""Dockerfile, Dockerfile.cuda and compose.yaml hold together without Docker: every command they
run is one of ours, every flag they pass is one its parser lists (with a value among its
choices), the compose services point at each other's addresses, the model path is where
`pdserve download` puts the default model in the image, and the example secret is refused."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
CHOICES = re.compile(r"(--[a-z][a-z0-9-]*) \{([^}]*)\}")


def compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def help_text(command: list[str], capsys) -> str:
    """The --help of `pdserve SUB` or `python -m pdserve.router`, from its own parser."""
    if command[:3] == ["python", "-m", "pdserve.router"]:
        from pdserve.router.__main__ import main

        argv = ["--help"]
    else:
        assert command[0] == "pdserve", command
        from pdserve.commands.cli import main

        argv = [command[1], "--help"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code in (0, None), f"{command}: --help exited {exit_info.value.code}"
    return capsys.readouterr().out


def check_flags(command: list[str], capsys) -> None:
    """Every --flag of `command` is one its parser lists, with a value among its choices."""
    text = help_text(command, capsys)
    known = set(FLAG.findall(text))
    choices = {flag: values.split(",") for flag, values in CHOICES.findall(text)}
    args = command[3:] if command[0] == "python" else command[2:]
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        assert flag in known, f"{' '.join(command[:3])} has no {flag}; it lists {sorted(known)}"
        if flag in choices:
            value = arg.split("=", 1)[1] if "=" in arg else args[i + 1]
            assert value in choices[flag], f"{flag} {value}: expected one of {choices[flag]}"


def dockerfile_commands(name: str) -> list[list[str]]:
    """The ENTRYPOINT, and each `pdserve ...` a RUN line runs, as argv lists."""
    text = (REPO / name).read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.startswith("ENTRYPOINT"):
            commands.append(json.loads(line.removeprefix("ENTRYPOINT")))
        elif line.startswith("RUN"):
            for run in re.findall(r"\bpdserve [a-z][^;&|]*", line):
                commands.append(shlex.split(run))
    return commands


def service_command(service: dict) -> list[str]:
    return [str(a) for a in service["entrypoint"] + service["command"]]


def flag_value(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command) if arg == flag]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_serves_on_every_interface_with_existing_flags(name, capsys):
    commands = dockerfile_commands(name)
    assert ["pdserve", "serve", "--host", "0.0.0.0"] in commands
    assert any(c[:2] == ["pdserve", "download"] for c in commands)
    for command in commands:
        check_flags(command, capsys)


def test_compose_services_pass_only_existing_flags(capsys):
    services = compose()["services"]
    assert set(services) == {"router", "prefill", "decode"}
    for service in services.values():
        check_flags(service_command(service), capsys)


def test_compose_nodes_and_router_reach_each_other_over_zmq():
    services = compose()["services"]
    router = service_command(services["router"])
    router_port = flag_value(router, "--listen")[0].rsplit(":", 1)[1]
    listed = set(flag_value(router, "--node"))
    for role in ("prefill", "decode"):
        node = service_command(services[role])
        assert node[:2] == ["pdserve", role]
        assert flag_value(node, "--router") == [f"tcp://router:{router_port}"]
        assert flag_value(node, "--kv-transport") == ["zmq"]
        (node_id,) = flag_value(node, "--node-id")
        (advertise,) = flag_value(node, "--advertise")
        assert advertise.startswith(f"tcp://{role}:")
        assert flag_value(node, "--listen") == [advertise.replace(role, "0.0.0.0")]
        assert f"{node_id}={advertise}" in listed
    (kv_listen,) = flag_value(service_command(services["decode"]), "--kv-listen")
    assert not kv_listen.startswith("tcp://0.0.0.0"), "the prefill node would dial 0.0.0.0"


def test_compose_router_is_published_and_probed_on_health():
    router = compose()["services"]["router"]
    command = service_command(router)
    port = flag_value(command, "--port")[0]
    assert flag_value(command, "--host") == ["0.0.0.0"]
    assert any(p.endswith(f":{port}") for p in router["ports"])
    assert f"http://127.0.0.1:{port}/health" in " ".join(router["healthcheck"]["test"])


def test_compose_model_is_where_the_image_downloads_the_default_model():
    from pdserve.model_store.default_model import default_model_dir

    env = re.search(r"PDSERVE_HOME=(\S+)", (REPO / "Dockerfile").read_text()).group(1)
    expected = str(default_model_dir(Path(env)))
    for name, service in compose()["services"].items():
        assert flag_value(service_command(service), "--model") == [expected], name
        assert service["build"]["args"]["PDSERVE_DOWNLOAD"] == "default"


def test_compose_secret_comes_from_an_env_file_whose_example_is_refused():
    from pdserve.wire.cluster_auth import SECRET_ENV, check_secret

    for name, service in compose()["services"].items():
        assert service["env_file"] == "pdserve.env", name
        assert "--cluster-secret" not in service_command(service), "a secret in compose.yaml"
    example = (REPO / "pdserve.env.example").read_text()
    placeholder = re.search(rf"^{SECRET_ENV}=(.*)$", example, re.MULTILINE).group(1)
    with pytest.raises(ValueError, match="openssl rand"):
        check_secret(placeholder)
    assert "pdserve.env" in (REPO / ".dockerignore").read_text().split()


def test_cpu_image_installs_the_mooncake_extra_and_the_library_it_loads(tmp_path):
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    (extras,) = re.findall(r"^ARG PDSERVE_EXTRAS=(\S*)$", text, re.MULTILINE)
    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras.split(",") == ["mooncake"] and "mooncake" in optional
    (install,) = [line for line in text.splitlines() if "pip install" in line and "/wheels" in line]
    (libraries,) = [line for line in text.splitlines() if "apt-get install" in line]
    assert "libibverbs1" in libraries and "*,mooncake,*" in libraries
    # The wheel's name with the extras appended, as the RUN line's shell expands it.
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "pdserve-1.0-py3-none-any.whl").touch()
    (argument,) = re.findall(r'"(\$\(ls /wheels[^"]*)"', install)
    argument = argument.replace("/wheels", str(wheels))
    for value, expected in ((extras, f"[{extras}]"), ("", "")):
        expanded = subprocess.run(
            ["bash", "-c", f'PDSERVE_EXTRAS={value} && echo "{argument}"'],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        assert expanded == f"{wheels}/pdserve-1.0-py3-none-any.whl{expected}"
