"""The LoRA adapters' device slots: the tree beside the params that every step reads (atlasjax/lora.py's
`LoRAManager` decides which adapter goes in which slot and which engine slot runs which).

    {"layers": {layer: {module: {linear: {"a": [max_loras, in, R], "b": [max_loras, R, out]}}}},
     "adapter_of_slot": [max_num_seqs] int32 (-1: the base model)}

R = max_lora_rank x the projection's parts. Under tensor parallelism the stacks are split as their weights are
(`sharding.lora_specs`), b's columns laid out device by device (`lora.DeviceSplit`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def _write_slot(stacks, index, arrays):
    """stacks with slot `index` of every leaf replaced by arrays' (the old stacks stay valid: not donated)."""
    return jax.tree.map(lambda stack, new: stack.at[index].set(new.astype(stack.dtype)), stacks, arrays)


class LoRASlots:
    """Zeroed slots for `max_loras` adapters of rank up to `max_rank` on the linear layers of `layout`
    (lora.targets), every engine slot on the base model. Made before the steps compile (they read `tree`)."""

    def __init__(self, layout, max_loras: int, max_rank: int, split, dtype, max_num_seqs: int, plan=None):
        self.plan = plan
        layers: dict = {}
        for t in layout:
            width = len(t.parts) * max_rank
            layers.setdefault(t.path[0], {}).setdefault(t.path[1], {})[t.path[2]] = {
                "a": jnp.zeros((max_loras, t.in_features, width), dtype),
                "b": jnp.zeros((max_loras, width, split.out_features(t)), dtype)}
        self._shardings = None
        if plan is not None:
            from jax.sharding import NamedSharding  # noqa: PLC0415

            from atlasjax.sharding import lora_specs  # noqa: PLC0415
            self._shardings = jax.tree.map(lambda spec: NamedSharding(plan.mesh, spec), lora_specs(layers))
            layers = jax.device_put(layers, self._shardings)
        self._adapter_of_slot = np.full(max_num_seqs, -1, np.int32)
        self.tree = {"layers": layers, "adapter_of_slot": self._place(self._adapter_of_slot)}

    def write(self, index: int, arrays: dict) -> None:
        """Slot `index` takes an adapter: arrays, `lora.Adapter.slot_arrays` (host arrays, one slot's)."""
        layers = _write_slot(self.tree["layers"], jnp.int32(index), arrays)
        if self._shardings is not None:   # (a no-op where the update kept each stack's split)
            layers = jax.device_put(layers, self._shardings)
        self.tree = dict(self.tree, layers=layers)

    def assign(self, pairs) -> None:
        """(engine slot, LoRA slot or -1) each: what the steps read for the requests admitted to those slots."""
        for slot, index in pairs:
            self._adapter_of_slot[slot] = index
        self.tree = dict(self.tree, adapter_of_slot=self._place(self._adapter_of_slot.copy()))

    def _place(self, host: np.ndarray) -> jax.Array:
        """A small host array on the device (replicated over the mesh under tensor parallelism)."""
        return jax.device_put(host, None if self.plan is None else self.plan.replicated)
