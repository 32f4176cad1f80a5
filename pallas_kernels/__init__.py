"""pallas_kernels: the Mosaic GPU kernels and their jnp references.

Importing the package memoizes the lowering of its kernels (lowering_memo.py): a kernel shared by
many step programs is lowered to its Mosaic GPU module once per process."""
from pallas_kernels import lowering_memo as _lowering_memo

_lowering_memo.install()
