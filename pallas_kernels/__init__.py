"""pallas_kernels."""
