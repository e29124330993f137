"""tpengine's kernels, installed as tpengine.kernels: `triton` (the paged KV cache and attention on
CUDA, or on the CPU under TRITON_INTERPRET=1) and `cpu` (C++ paged decode attention, fused ops, the
shared-memory all-reduce and the AVX512-BF16 linear, built on first use)."""
