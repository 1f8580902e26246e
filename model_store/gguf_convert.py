"""Convert a llama-architecture GGUF file into an ordinary Hugging Face model folder.

transformers' GGUF loader dequantizes the tensors (and undoes llama.cpp's q/k permutation) and
builds the fast tokenizer with the chat template; this module writes them out as
config.json, model.safetensors, generation_config.json and tokenizer files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_CHAT_END_TOKEN = "<|im_end|>"


def convert_gguf_to_model_folder(gguf_path: Path, out_dir: Path) -> None:
    """Convert a llama-architecture GGUF file into a Hugging Face model folder.

    Writes ``config.json`` (fp32 ``LlamaForCausalLM``), ``model.safetensors`` (dequantized fp32
    weights in HF naming; ``lm_head.weight`` is left out when the embeddings are tied, i.e. when
    the GGUF has no separate ``output.weight``), ``generation_config.json`` and the tokenizer
    files (``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``, both
    carrying the chat template).  ``out_dir`` is created if needed.  This does not write the
    completion marker; :func:`ensure_default_model` does that once everything is in place.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # --- metadata ---
    # (Each GGUF parse costs seconds: the metadata holds the whole vocabulary.)
    meta = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    architecture = meta["config"].get("model_type")
    if architecture != "llama":
        raise ValueError(f"{gguf_path}: expected a llama GGUF file, got {architecture!r}")
    # transformers derives this from the absence of a separate ``output.weight`` tensor.
    tied = bool(meta["config"]["tie_word_embeddings"])

    # --- tokenizer (built from the GGUF vocabulary, merges and chat template) ---
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path}: the GGUF file carries no chat template")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # --- config ---
    config_kwargs = _llama_config_kwargs(meta["config"], tokenizer, tied)
    config = LlamaConfig(**config_kwargs)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"
    tokenizer.model_max_length = config.max_position_embeddings

    # --- weights ---
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    expected = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    if tied:
        expected.pop("lm_head.weight", None)
    checkpoint = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    del skeleton
    tensors: dict[str, Any] = checkpoint["tensors"]
    if tied:
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{gguf_path}: tensor names do not match LlamaForCausalLM "
            f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"{gguf_path}: {name} has shape {tuple(tensor.shape)}, expected {expected[name]}"
            )
    state = {name: tensors[name].to(torch.float32).contiguous() for name in sorted(tensors)}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state, tensors, checkpoint

    # --- config / generation config / tokenizer files ---
    config.save_pretrained(out_dir)
    _finalize_config_json(out_dir / "config.json", config_kwargs["rope_theta"])

    eos_ids = _eos_token_ids(config.eos_token_id, tokenizer)
    generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    generation_config.save_pretrained(out_dir)

    tokenizer.save_pretrained(out_dir)
    _ensure_chat_template(out_dir, tokenizer.chat_template)





def _clean_float(value: Any) -> float:
    """Drop float32 round-off from GGUF metadata (9.999999747378752e-06 -> 1e-05)."""
    return float(f"{float(value):.7g}")


def _llama_config_kwargs(gguf_config: dict[str, Any], tokenizer: Any, tied: bool) -> dict:
    """LlamaConfig keyword arguments from the config part of load_gguf_checkpoint()."""
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
    )
    absent = [key for key in required if key not in gguf_config]
    if absent:
        raise ValueError(f"GGUF metadata lacks {', '.join(absent)}")
    kwargs: dict[str, Any] = {key: int(gguf_config[key]) for key in required}
    heads = kwargs["num_attention_heads"]
    kwargs["num_key_value_heads"] = int(gguf_config.get("num_key_value_heads", heads))
    kwargs["head_dim"] = int(gguf_config.get("head_dim", kwargs["hidden_size"] // heads))
    kwargs["rms_norm_eps"] = _clean_float(gguf_config.get("rms_norm_eps", 1e-5))
    kwargs["rope_theta"] = _clean_float(gguf_config.get("rope_theta", 10000.0))
    kwargs["hidden_act"] = "silu"
    kwargs["attention_bias"] = False
    kwargs["mlp_bias"] = False
    kwargs["tie_word_embeddings"] = tied

    def token_id(key: str, fallback: int | None) -> int | None:
        value = gguf_config.get(key)
        return int(value) if value is not None else fallback

    kwargs["bos_token_id"] = token_id("bos_token_id", tokenizer.bos_token_id)
    kwargs["eos_token_id"] = token_id("eos_token_id", tokenizer.eos_token_id)
    kwargs["pad_token_id"] = token_id("pad_token_id", tokenizer.pad_token_id)
    return kwargs


def _eos_token_ids(config_eos: int | list[int] | None, tokenizer: Any) -> list[int]:
    """The config's eos id(s) plus the chat end token ``<|im_end|>`` (if in the vocabulary)."""
    if config_eos is None:
        ids: list[int] = []
    elif isinstance(config_eos, int):
        ids = [config_eos]
    else:
        ids = [int(i) for i in config_eos]
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids(_CHAT_END_TOKEN)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.append(im_end)
    return list(dict.fromkeys(ids))


def _finalize_config_json(config_path: Path, rope_theta: float) -> None:
    """Pin ``architectures`` and add a top-level ``rope_theta``.

    transformers 5 keeps rope_theta only inside ``rope_parameters``; older versions (and
    loaders that read config.json directly) look for the top-level key, which transformers 5
    accepts as well.
    """
    data = json.loads(config_path.read_text(encoding="utf-8"))
    data["architectures"] = ["LlamaForCausalLM"]
    data.setdefault("rope_theta", rope_theta)
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", "utf-8")


def _ensure_chat_template(out_dir: Path, chat_template: str) -> None:
    """Have the chat template both in tokenizer_config.json and in chat_template.jinja.

    transformers 5 saves it only as chat_template.jinja; older versions and tools that read
    tokenizer_config.json directly look for the ``chat_template`` key.  The tokenizer class is
    recorded as ``PreTrainedTokenizerFast`` (an alias of transformers 5's TokenizersBackend)
    so that older transformers versions can load the folder too.
    """
    config_path = out_dir / "tokenizer_config.json"
    data = json.loads(config_path.read_text(encoding="utf-8"))
    data["chat_template"] = chat_template
    for load_time_key in ("is_local", "local_files_only"):  # loader state, not configuration
        data.pop(load_time_key, None)
    if data.get("tokenizer_class") == "TokenizersBackend":
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", "utf-8")
    jinja_path = out_dir / "chat_template.jinja"
    if not jinja_path.is_file():
        jinja_path.write_text(chat_template, encoding="utf-8")
