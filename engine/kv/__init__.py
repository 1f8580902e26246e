"""The KV cache and its blocks: the buffer, the block pool and manager, held blocks, block moves,
host swap space, the shared-memory cache, FP8 scales, and how many blocks admission reserves."""
