"""Triton kernels for paged attention and KV movement, with pure-torch references.

Each kernel sits beside the wrapper that checks its arguments and launches it: store_kv.py,
decode_attention.py, prefill_attention.py, block_copy.py. cpu_decode_attention.py is the
CPU's decode attention and cpu_gemv.py its one-token bf16 linear, compiled by numba instead of
Triton (numba_threads.py: how they run in parallel; llvm_prefetch.py: the prefetch they emit). reference.py defines what each
computes; launch.py holds what the wrappers share; tiles.py sizes the attention tiles to the
device's shared memory. This package imports nothing from the rest of the project.
"""
