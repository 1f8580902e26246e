"""cuda_ipc: KV written by a prefill process's GPU arrives bit-exact in a decode process's GPU
buffer shared by CUDA IPC handle. Needs CUDA; skipped without it."""

from __future__ import annotations

import uuid

import pytest
import torch

from pdserve.kvtransfer.peer import PeerProcess

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_kv_arrives_bit_exact_through_a_cuda_ipc_handle(tmp_path, dtype):
    decode, prefill = PeerProcess(tmp_path / "decode.log"), PeerProcess(tmp_path / "prefill.log")
    try:
        descriptor = decode.call(
            "open_receiver", name="gpu", transport="cuda_ipc",
            node_id=f"g{uuid.uuid4().hex[:8]}", num_blocks=64, device="cuda",
            spec={"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16,
                  "dtype": dtype},
        )["descriptor"]
        prefill.call(
            "open_sender", name="gpu", transport="cuda_ipc", descriptor=descriptor, seed=7, num_blocks=64, device="cuda",
        )
        src, dst = [3, 4, 5, 60, 1], [40, 2, 17, 18, 63]
        decode.call("expect", name="gpu", transfer_id="req-gpu", block_ids=dst, deadline_s=20)
        prefill.call("write", name="gpu", transfer_id="req-gpu", src=src[:3], dst=dst[:3])
        prefill.call("write", name="gpu", transfer_id="req-gpu", src=src[3:], dst=dst[3:])
        assert prefill.call("wait", name="gpu", transfer_id="req-gpu", wait_s=20)["kind"] == (
            "complete"
        )
        assert decode.call("wait", name="gpu", transfer_id="req-gpu", wait_s=20)["kind"] == (
            "complete"
        )
        assert decode.call("hashes", name="gpu", block_ids=dst) == prefill.call(
            "hashes", name="gpu", block_ids=src
        )
        prefill.call("close", name="gpu")
        decode.call("close", name="gpu")
    finally:
        prefill.stop()
        decode.stop()
