"""tpengine's kernels, installed as tpengine.kernels: `triton` (the paged KV cache and attention on
CUDA, or on the CPU under TRITON_INTERPRET=1) and `cpu` (C++ paged decode attention, built on first use)."""
