"""Bad input fails at once with a ValueError that says what was wrong."""

from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 12}, "block_size"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"dtype": "float8"}, "dtype"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ],
)
def test_bad_engine_config_raises_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_token_ids_outside_the_vocabulary_are_rejected(clean_tiny_llm):
    with pytest.raises(ValueError, match=r"token id 512 is outside the vocabulary \[0, 512\)"):
        clean_tiny_llm.generate([[5, 6, 512]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="token id -1"):
        clean_tiny_llm.generate([[-1, 6]], SamplingParams(max_tokens=4))


def test_too_long_prompt_names_the_maximum_context_length(clean_tiny_llm):
    with pytest.raises(ValueError, match="maximum context length") as info:
        clean_tiny_llm.generate([[5] * 1000], SamplingParams(max_tokens=100))
    assert "1,000 tokens" in str(info.value)
    assert "1,024 tokens" in str(info.value)


def test_request_larger_than_the_whole_cache_is_rejected_at_submit(tiny_llama_dir):
    from pdserve.engine import LLM

    llm = LLM(str(tiny_llama_dir), num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV cache holds only 4"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=8))
    assert llm.engine.block_manager.num_free_blocks == 4


def test_one_bad_prompt_rejects_the_batch_before_any_work(clean_tiny_llm):
    with pytest.raises(ValueError):
        clean_tiny_llm.generate([[5, 6], [5, 9999]], SamplingParams(max_tokens=4))
    assert not clean_tiny_llm.engine.has_unfinished_requests()


def test_empty_prompt_list_returns_empty_list(clean_tiny_llm):
    assert clean_tiny_llm.generate([], SamplingParams()) == []


def test_empty_prompt_is_rejected(clean_tiny_llm):
    with pytest.raises(ValueError, match="empty"):
        clean_tiny_llm.generate([[]], SamplingParams(max_tokens=4))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    from pdserve.engine import LLM

    GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported") as info:
        LLM(str(tmp_path))
    assert "LlamaForCausalLM" in str(info.value)
    assert "Qwen3ForCausalLM" in str(info.value)


def test_checkpoint_missing_a_weight_fails_naming_it(tiny_llama_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from pdserve.engine import LLM

    for item in tiny_llama_dir.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, tmp_path / item.name)
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight"):
        LLM(str(tmp_path))
