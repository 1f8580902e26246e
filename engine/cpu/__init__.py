"""What the CPU offers and how the engine uses it: bf16 instructions and the dtype they choose,
huge pages, and glibc malloc kept from returning freed memory."""
