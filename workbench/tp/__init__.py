"""Tensor parallelism across the GPUs of one host: how every layer is split over N ranks (shard), and the decode
step computed that way, all-reduces included, as reference math to hold the ranks' kernels to (reference)."""
