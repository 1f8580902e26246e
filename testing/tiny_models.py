"""Tiny random-weight models of each supported family, saved as ordinary model folders: what
the tests and bench's GPU check (bench/gpu_checks.py) serve and compare against transformers.

The weights are drawn with a wide initializer so greedy choices are decisive (far from ties),
which keeps token-exact comparisons meaningful rather than a coin toss on rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 512
COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "initializer_range": 0.25,
}


def tiny_configs() -> dict[str, object]:
    return {
        "llama": LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False),
        "llama3-rope-tied": LlamaConfig(
            **COMMON,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
        "mistral": MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=4096),
        "qwen2": Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),
        "qwen3": Qwen3Config(
            **COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False
        ),
    }


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (ids 3..258 are bytes) padded out to the tiny vocabulary."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    for i, ch in enumerate(sorted(byte_chars)):
        vocab[ch] = 3 + i
    for i in range(len(vocab), VOCAB_SIZE):
        vocab[f"<extra_{i}>"] = i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return fast


def save_tiny_model(kind: str, folder: Path, seed: int = 0) -> Path:
    config = tiny_configs()[kind]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder
