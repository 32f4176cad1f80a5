"""pallas_kernels: the Mosaic GPU kernels and their jnp references.

Importing the package memoizes Mosaic GPU kernel lowering (lowering_memo.py; ATLASJAX_KERNEL_LOWERING_MEMO=off
turns it off): a kernel shared by many step programs is lowered once per process."""
from pallas_kernels import lowering_memo as _lowering_memo

_lowering_memo.install()
