"""A short fingerprint of the model a KV cache belongs to.

Two nodes may exchange KV blocks only when their models agree on everything that shapes and
gives meaning to those blocks. The fingerprint hashes the architecture and the shapes, plus
config.json itself (parsed and re-serialized with sorted keys, so formatting does not matter).
Weights are not hashed: reading them takes seconds; nodes are expected to load the same folder.
"""

from __future__ import annotations

import hashlib
import json

from pdserve.engine.model_config import ModelConfig


def model_fingerprint(model_config: ModelConfig) -> str:
    config_path = model_config.path / "config.json"
    with open(config_path, encoding="utf-8") as config_file:
        canonical_config = json.dumps(json.load(config_file), sort_keys=True)
    identity = {
        "architecture": model_config.architecture,
        "num_layers": model_config.num_layers,
        "num_heads": model_config.num_heads,
        "num_kv_heads": model_config.num_kv_heads,
        "head_dim": model_config.head_dim,
        "vocab_size": model_config.vocab_size,
        "config_sha256": hashlib.sha256(canonical_config.encode()).hexdigest(),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return f"{model_config.architecture}-{model_config.num_layers}L-{digest[:16]}"
