"""KV transfer on GPUs: a decode node whose allocator uses expandable segments refuses cuda_ipc
at registration with a message naming the setting; zmq stages GPU blocks through pinned memory
on side streams and still delivers them bit-exact between two processes. The CUDA cases skip
without a GPU."""

from __future__ import annotations

import uuid

import pytest
import torch

from pdserve.kvtransfer.peer import PeerProcess
from pdserve.kvtransfer.transports.cuda_ipc import (
    check_shareable_allocator,
    expandable_segments_setting,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SPEC = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}


@pytest.mark.parametrize(
    "environ, found",
    [
        ({}, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None),
        (
            {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"},
            "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:64, expandable_segments:True",
        ),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_ALLOC_CONF="),
    ],
)
def test_expandable_segments_are_found_in_either_allocator_setting(environ, found):
    setting = expandable_segments_setting(environ)
    if found is None:
        assert setting is None
    else:
        assert setting.startswith(found)


def test_registration_refusal_names_the_setting_and_a_way_out():
    with pytest.raises(ValueError, match="PYTORCH_ALLOC_CONF=expandable_segments:True") as caught:
        check_shareable_allocator({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert "--kv-transport zmq" in str(caught.value)
    check_shareable_allocator({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})


@needs_cuda
def test_a_decode_peer_with_expandable_segments_refuses_cuda_ipc(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    decode = PeerProcess(tmp_path / "decode.log")
    try:
        with pytest.raises(RuntimeError, match="expandable_segments:True"):
            decode.call(
                "open_receiver", name="gpu", transport="cuda_ipc", node_id="refuses",
                num_blocks=8, device="cuda", spec={**SPEC, "dtype": "bfloat16"},
            )
    finally:
        decode.stop()


@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_kv_arrives_bit_exact_over_zmq_through_pinned_staging(tmp_path, dtype):
    decode, prefill = PeerProcess(tmp_path / "decode.log"), PeerProcess(tmp_path / "prefill.log")
    try:
        descriptor = decode.call(
            "open_receiver", name="gpu", transport="zmq", node_id=f"z{uuid.uuid4().hex[:8]}",
            num_blocks=48, device="cuda", spec={**SPEC, "dtype": dtype},
        )["descriptor"]
        prefill.call(
            "open_sender", name="gpu", transport="zmq", descriptor=descriptor, seed=5,
            num_blocks=48, device="cuda", step_bytes=1 << 16, window=1 << 18,
        )
        src, dst = [9, 3, 4, 5, 40, 1, 22], [30, 2, 17, 18, 47, 0, 11]
        decode.call("expect", name="gpu", transfer_id="req-zmq", block_ids=dst, deadline_s=20)
        prefill.call("write", name="gpu", transfer_id="req-zmq", src=src[:4], dst=dst[:4])
        prefill.call("write", name="gpu", transfer_id="req-zmq", src=src[4:], dst=dst[4:])
        for peer in (prefill, decode):
            assert peer.call("wait", name="gpu", transfer_id="req-zmq", wait_s=20)["kind"] == (
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
