"""Models are built directly in their dtype, and `load_format` "dummy" runs a config-only folder.

Building on the device in fp32 and casting afterwards held an 8B model's weights twice (and
left the freed fp32 copy counted as used when the KV cache was sized); building on the meta
device shows a model's shapes and size without allocating anything.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.runner.loader import build_model, load_model
from pdserve.node.cli import engine_config, node_parser
from pdserve.testing.tiny_models import tiny_configs

LLAMA_3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "tie_word_embeddings": False,
}
LLAMA_3_8B_PARAMETERS = 8_030_261_248


class TensorsMade(TorchDispatchMode):
    """Records the dtype and shape of every tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.made.append((tensor.dtype, tuple(tensor.shape)))
        return out


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory):
    """config.json alone: no weights, no tokenizer."""
    folder = tmp_path_factory.mktemp("config-only")
    config = tiny_configs()["llama"]
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    return folder


def test_a_bf16_model_never_has_an_fp32_copy_of_any_weight(tiny_llama_dir, tmp_path):
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    bf16.save_pretrained(tmp_path)
    config = ModelConfig.from_folder(tmp_path)
    with TensorsMade() as recorder:
        model = load_model(config, 1024, torch.bfloat16, torch.device("cpu"))
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    fp32_weight_sized = [
        shape for dtype, shape in recorder.made
        if dtype == torch.float32 and shape in weight_shapes
    ]
    assert fp32_weight_sized == []
    assert model.rotary.cos_table.dtype == torch.float32  # rope tables stay exact


def test_the_llama_3_8b_shape_builds_on_the_meta_device_with_its_parameter_count(tmp_path):
    LlamaConfig(architectures=["LlamaForCausalLM"], **LLAMA_3_8B).save_pretrained(tmp_path)
    config = ModelConfig.from_folder(tmp_path)
    model = build_model(config, 8192, torch.bfloat16, "meta")
    parameters = list(model.parameters())
    assert sum(p.numel() for p in parameters) == LLAMA_3_8B_PARAMETERS
    assert {p.device.type for p in parameters} == {"meta"}
    assert {p.dtype for p in parameters} == {torch.bfloat16}


def greedy_tokens(engine: LLMEngine, prompt: list[int], max_tokens: int = 12) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens += output.new_token_ids
    return tokens


def test_dummy_weights_from_a_config_only_folder_give_seeded_deterministic_greedy_tokens(
    config_only_dir,
):
    def engine(seed: int) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(config_only_dir), load_format="dummy", seed=seed, num_kv_blocks=32
            )
        )

    first, again, other_seed = engine(0), engine(0), engine(1)
    assert first.tokenizer is None  # token ids only
    prompt = [5, 77, 300, 12, 9, 401]
    tokens = greedy_tokens(first, prompt)
    assert len(tokens) == 12
    assert greedy_tokens(again, prompt) == tokens
    assert greedy_tokens(other_seed, prompt) != tokens
    weights = dict(first.runner.model.named_parameters())
    assert weights["norm.weight"].eq(1).all()
    assert weights["embed_tokens.weight"].std().item() == pytest.approx(0.25, rel=0.1)
    first.check_integrity()


def test_dummy_weights_keep_a_tied_head_equal_to_the_embedding(tmp_path):
    hf_config = tiny_configs()["qwen2"]  # tie_word_embeddings
    hf_config.architectures = ["Qwen2ForCausalLM"]
    hf_config.save_pretrained(tmp_path)
    config = ModelConfig.from_folder(tmp_path)
    model = load_model(config, 64, torch.bfloat16, torch.device("cpu"), "dummy", seed=3)
    # The head may be prepacked (its weight dropped): compare what it computes.
    hidden = torch.randn(3, hf_config.hidden_size, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(hidden, model.embed_tokens.weight)
    torch.testing.assert_close(model.lm_head(hidden), expected, rtol=2e-2, atol=2e-2)
    assert model.layers[0].self_attn.qkv_proj.bias.eq(0).all()


def test_dummy_weights_with_a_tokenizer_in_the_folder_keep_the_tokenizer(tiny_llama_dir):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), load_format="dummy", num_kv_blocks=16)
    )
    assert engine.tokenizer is not None


def test_a_config_only_folder_without_dummy_says_how_to_load_it(config_only_dir):
    config = ModelConfig.from_folder(config_only_dir)
    with pytest.raises(ValueError, match="holds no \\*.safetensors.*'dummy'"):
        load_model(config, 64, torch.float32, torch.device("cpu"))


def test_an_unknown_load_format_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="load_format must be one of .*'auto'.*'dummy'.*'npz'"):
        EngineConfig(load_format="npz")


def test_the_node_command_line_passes_load_format_to_the_engine(config_only_dir):
    parser = node_parser("node", "test")
    common = ["--node-id", "n", "--listen", "tcp://127.0.0.1:1", "--router", "tcp://127.0.0.1:2"]
    args = parser.parse_args([*common, "--model", str(config_only_dir), "--load-format", "dummy"])
    assert engine_config(args).load_format == "dummy"
    assert engine_config(parser.parse_args(common)).load_format == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([*common, "--load-format", "npz"])

