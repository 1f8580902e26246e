"""The GPU-facing engine options on a CPU machine: `attention_backend="auto"` and CUDA graphs
resolve from the device (CUDA availability mocked), and `--attention-backend`,
`--enforce-eager`, `--gpu-memory-utilization`, `--processes-on-device` and `--device` parse on
every command line and reach EngineConfig."""

from __future__ import annotations

import pytest
import torch

from pdserve import engine
from pdserve.commands.cli import build_parser, cmd_serve
from pdserve.engine.config import EngineConfig
from pdserve.node.cli import engine_config, node_parser, use_device


@pytest.fixture
def cuda_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def node_args(*flags: str):
    parser = node_parser("test-node", "")
    return parser.parse_args(["--node-id", "n", "--listen", "tcp://127.0.0.1:1",
                              "--router", "tcp://127.0.0.1:2", *flags])


def test_auto_attention_is_torch_without_graphs_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = EngineConfig()
    assert (config.attention_backend, config.cuda_graphs) == ("torch", False)


def test_auto_attention_is_triton_with_graphs_when_cuda_is_available(cuda_available):
    config = EngineConfig()
    assert (config.attention_backend, config.cuda_graphs) == ("triton", True)
    assert EngineConfig(cuda_graphs=False).cuda_graphs is False
    assert EngineConfig(attention_backend="torch").cuda_graphs is False
    explicit_cpu = EngineConfig(device="cpu")
    assert (explicit_cpu.attention_backend, explicit_cpu.cuda_graphs) == ("torch", False)


def test_unknown_attention_backend_names_every_valid_choice():
    with pytest.raises(ValueError, match=r"'flash' is unknown; valid: torch, triton, or 'auto'"):
        EngineConfig(attention_backend="flash")


def test_processes_on_device_below_one_is_refused_with_its_value():
    with pytest.raises(ValueError, match="processes_on_device must be >= 1, got 0"):
        EngineConfig(processes_on_device=0)


def test_node_flags_reach_engine_config(cuda_available):
    config = engine_config(node_args(
        "--attention-backend", "triton", "--enforce-eager", "--gpu-memory-utilization", "0.6",
        "--processes-on-device", "3", "--device", "cuda:1",
    ))
    assert config.attention_backend == "triton"
    assert config.cuda_graphs is False
    assert config.gpu_memory_utilization == 0.6
    assert config.processes_on_device == 3
    assert config.device == "cuda:1"
    defaults = engine_config(node_args())
    assert (defaults.attention_backend, defaults.cuda_graphs) == ("triton", True)
    assert (defaults.gpu_memory_utilization, defaults.processes_on_device) == (0.9, 1)


def test_node_makes_its_device_current_and_refuses_one_it_cannot_see(monkeypatch):
    current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    use_device(torch.device("cuda", 1))
    use_device(torch.device("cuda"))  # no index: the current device already
    use_device(torch.device("cpu"))
    assert current == [torch.device("cuda", 1)]
    with pytest.raises(ValueError, match="cuda:2 is not visible: this process sees 2"):
        use_device(torch.device("cuda", 2))


def test_generate_flags_reach_the_llm(monkeypatch, cuda_available):
    made = {}

    def fake_llm(model, **options):
        made["config"] = EngineConfig(model=model, **options)
        return made

    monkeypatch.setattr(engine, "LLM", fake_llm)
    from pdserve.commands.cli import _make_llm

    _make_llm(build_parser().parse_args(["generate", "hi", "--enforce-eager",
                                         "--gpu-memory-utilization", "0.5"]))
    config = made["config"]
    assert (config.attention_backend, config.cuda_graphs) == ("triton", False)
    assert config.gpu_memory_utilization == 0.5
    _make_llm(build_parser().parse_args(["chat", "--attention-backend", "torch"]))
    assert made["config"].attention_backend == "torch"


def test_serve_refuses_a_memory_fraction_outside_zero_to_one(capsys):
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "1.2"])
    with pytest.raises(SystemExit):
        cmd_serve(args)
    assert "--gpu-memory-utilization must be in (0, 1], got 1.2" in capsys.readouterr().err
