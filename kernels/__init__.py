"""The monokernel's CUDA sources and, next to each section, its numpy reference (kernels/sections)."""
