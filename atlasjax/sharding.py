"""Tensor parallelism: the device mesh, the one rules table, sharded placement, and shard_map.

Layout (Megatron): q/k/v and gate/up are column-parallel (split over heads / mlp), o_proj and
down_proj row-parallel (one all-reduce after each), the embedding and LM head vocab-parallel (a
masked lookup + all-reduce; logits all-gathered so sampling sees the whole distribution). The KV
page pools are split over KV heads. Everything here follows from `LOGICAL_AXIS_RULES`; the model
files only name logical axes.

KV heads when there are fewer than devices (`num_kv_heads < tp`, e.g. 8B with 8 KV heads at
TP=16, or a 1-KV-head model at TP=2): each KV head is replicated `tp // num_kv_heads` times so that
every device holds exactly one (the k/v projections are widened at load, so device d computes
and caches KV head `d // replicas`). Otherwise `num_kv_heads % tp == 0` and each device holds
`num_kv_heads // tp` of them. `num_heads % tp == 0` and `intermediate_size % tp == 0` are
required; a vocab that does not split evenly is padded with zero rows (logits of the padding are
dropped before sampling).

The whole forward pass (embedding to logits) runs inside one `shard_map` over the `model` axis:
Pallas kernels need manual axes anyway, and it makes every collective explicit (one psum per
row-parallel projection, one for the embedding, one all-gather for the logits). Sampling runs on
the gathered logits, replicated, under plain jit.

Loading is sharded: each device receives only its slice of each tensor (safetensors slices are
read directly; other sources read one whole tensor at a time on the host). Quantized projections
(and a quantized LM head, `quantize_lm_head`: split over the vocab, padded like the bf16 one) are
split per device into independent `QuantizedWeight`s stacked on a leading device axis.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from atlasjax.errors import EngineConfigError
from atlasjax.quantization import cut, pad
from models.layers import is_quantized
from models.parallel import Parallel
from pallas_kernels.quant_format import ARRAY_FIELDS

MESH_AXES = ("data", "model", "expert")   # data: replicas (1 for now); expert: for MoE (1 for now)
TP_AXIS = "model"

# logical axis -> mesh axis (None: replicated). The only place model axes meet mesh axes.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", TP_AXIS),      # embedding rows, LM head columns
    ("heads", TP_AXIS),      # q_proj columns, o_proj rows
    ("kv_heads", TP_AXIS),   # k_proj / v_proj columns, KV page pools
    ("mlp", TP_AXIS),        # gate_proj / up_proj columns, down_proj rows
    ("embed", None),
    ("head_dim", None),
)


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if tensor_parallel_size > len(devices):
        raise EngineConfigError(f"tensor_parallel_size={tensor_parallel_size} but only {len(devices)} "
                                f"device(s) are visible ({devices[0].platform})")
    grid = np.asarray(devices[:tensor_parallel_size]).reshape(1, tensor_parallel_size, 1)
    return Mesh(grid, MESH_AXES)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How one model is split over the `model` axis of a mesh."""
    mesh: Mesh
    cfg: object   # ModelConfig

    def __post_init__(self):
        cfg, tp = self.cfg, self.size
        problems = []
        if cfg.num_heads % tp:
            problems.append(f"num_heads={cfg.num_heads} is not divisible by it")
        kvh = cfg.num_kv_heads
        if (kvh >= tp and kvh % tp) or (kvh < tp and tp % kvh):
            problems.append(f"num_kv_heads={kvh} neither divides nor is a multiple of it")
        if cfg.intermediate_size % tp:
            problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by it")
        if problems:
            raise EngineConfigError(f"tensor_parallel_size={tp} does not fit this model: " + "; ".join(problems))

    @property
    def size(self) -> int:
        return self.mesh.shape[TP_AXIS]

    @property
    def kv_replicas(self) -> int:
        """How many devices hold each KV head (1 unless num_kv_heads < tp)."""
        return max(1, self.size // self.cfg.num_kv_heads)

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the sharded pool and k/v projections, replicas included."""
        return self.cfg.num_kv_heads * self.kv_replicas

    @property
    def padded_vocab(self) -> int:
        return -(-self.cfg.vocab_size // self.size) * self.size

    @property
    def parallel(self) -> Parallel:
        return Parallel(tuple((logical, mesh) for logical, mesh in LOGICAL_AXIS_RULES if mesh))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def kv_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(TP_AXIS))

    # ---- per-parameter layout
    def spec(self, logical: tuple[str, ...]) -> P:
        return P(*nn.logical_to_mesh_axes(logical, LOGICAL_AXIS_RULES))

    def split_dim(self, logical: tuple[str, ...]) -> int | None:
        """The dimension split over the mesh (the rules split at most one per tensor), or None."""
        return next((i for i, axis in enumerate(self.spec(logical)) if axis is not None), None)

    def global_shape(self, logical: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
        """The placed (possibly widened / padded) shape of a checkpoint tensor of `shape`."""
        out = list(shape)
        for i, name in enumerate(logical):
            if name == "kv_heads" and self.kv_replicas > 1:
                out[i] = self.num_kv_heads * self.cfg.head_dim
            elif name == "vocab":
                out[i] = self.padded_vocab
        return tuple(out)

    def source_range(self, name: str, shard: int, full: int) -> tuple[int, int]:
        """[start, stop) along a split axis of the checkpoint tensor that shard `shard` holds."""
        if name == "kv_heads" and self.kv_replicas > 1:
            hd = self.cfg.head_dim
            head = shard // self.kv_replicas
            return head * hd, (head + 1) * hd
        if name == "vocab":
            local = self.padded_vocab // self.size
            return min(shard * local, full), min((shard + 1) * local, full)
        local = full // self.size
        return shard * local, (shard + 1) * local

    # ---- placing tensors
    def place_array(self, logical: tuple[str, ...], reader, transpose: bool, dtype) -> jax.Array:
        """Put one checkpoint tensor on the mesh, each device receiving only its slice.

        reader: `.shape` (checkpoint layout), `reader()` reads it whole, and `reader.read_range(axis,
        start, stop)`, where present, reads a slice (safetensors); otherwise the tensor is read
        whole once on the host and sliced there.
        """
        dim = self.split_dim(logical)
        if dim is None:
            return jax.device_put(_read(reader, transpose).astype(dtype), self.replicated)
        src_dim = len(logical) - 1 - dim if transpose else dim
        full = reader.shape[src_dim]
        shape = self.global_shape(logical, tuple(reader.shape[::-1] if transpose else reader.shape))
        local = shape[dim] // self.size
        whole = functools.cache(lambda: _read(reader, transpose))

        def callback(index):
            start, stop = self.source_range(logical[dim], (index[dim].start or 0) // local, full)
            if hasattr(reader, "read_range"):
                part = np.asarray(reader.read_range(src_dim, start, stop))
                part = part.T if transpose else part
            else:   # a host array, or one on a device (cut there: its pieces then move device to device)
                part = cut(whole(), dim, start, stop)
            if part.shape[dim] < local:   # the padded end of a vocab that does not split evenly
                part = pad(part, tuple((0, local - part.shape[dim]) if i == dim else (0, 0) for i in range(part.ndim)))
            return part.astype(dtype)
        return jax.make_array_from_callback(shape, NamedSharding(self.mesh, self.spec(logical)), callback)

    def place_quantized(self, qw, logical: tuple[str, ...]):
        """Split a QuantizedWeight [K, N] along its split axis into one QuantizedWeight per device,
        stored stacked on a leading device axis (each device holds its own, unpadded-between, copy)."""
        from atlasjax.quantization import slice_quantized  # noqa: PLC0415
        dim = self.split_dim(logical)
        if dim is None:
            raise EngineConfigError(f"a replicated quantized weight {logical} is not supported under tensor "
                                    "parallelism")

        @functools.cache
        def shard(d: int):
            if logical[dim] == "vocab":
                # A quantized LM head (`quantize_lm_head`): every device holds padded_vocab / tp columns,
                # the last ones past the vocab zero (their logits are dropped after the gather), so
                # that all the per-device weights have one shape.
                local = self.padded_vocab // self.size
                return slice_quantized(qw, dim, d * local, local)
            start, stop = self.source_range(logical[dim], d, qw.shape[dim])
            return slice_quantized(qw, dim, start, stop - start)

        first = shard(0)
        sharding = NamedSharding(self.mesh, P(TP_AXIS))

        def stacked(name):
            leaf = getattr(first, name)
            if leaf is None:
                return None
            return jax.make_array_from_callback(
                (self.size, *leaf.shape), sharding, lambda index: _local(getattr(shard(index[0].start or 0), name))[None])
        return dataclasses.replace(first, **{name: stacked(name) for name in ARRAY_FIELDS})

    def shard_params(self, params: dict, logical_tree: dict) -> dict:
        """Place an already-built param tree (host or one device) on the mesh, tensor by tensor."""
        def walk(node, logical):
            if isinstance(node, dict):
                return {k: walk(v, logical[k]) for k, v in node.items()}
            if is_quantized(node):
                return self.place_quantized(node, logical)
            from atlasjax.loader import TensorReader  # noqa: PLC0415
            return self.place_array(logical, TensorReader(node.shape, lambda: node), False, node.dtype)
        return walk(params, logical_tree)

    # ---- back to the checkpoint layout (LLM.save, the calibrations at start)
    def gather(self, params: dict, logical_tree: dict, device=None) -> dict:
        """The inverse of `shard_params`: the whole tree in checkpoint layout, with replicated KV
        heads taken once, padded vocab rows dropped and per-device quantized weights joined. On the
        host (memory: the whole model), or with `device` on that device, moved device to device
        (one process). Multi-host: every process must call it (each leaf is all-gathered across
        processes, in tree order), and every process gets the whole tree on its host."""
        if device is not None and not all(leaf.is_fully_addressable for leaf in jax.tree.leaves(params)):
            raise ValueError("gather onto one device needs every shard in this process")
        fetch = _to_host if device is None else functools.partial(jax.device_put, device=device)

        def walk(node, logical):
            if isinstance(node, dict):
                return {k: walk(v, logical[k]) for k, v in node.items()}
            if is_quantized(node):
                return self._join_quantized(node, logical, fetch)
            return self._unplace(fetch(node), logical)
        return walk(params, logical_tree)

    def _unplace(self, array, logical: tuple[str, ...]):
        for i, name in enumerate(logical):
            if name == "vocab":
                array = cut(array, i, 0, self.cfg.vocab_size)
                array = np.ascontiguousarray(array) if isinstance(array, np.ndarray) else array
            elif name == "kv_heads" and self.kv_replicas > 1:
                shape = array.shape
                split = shape[:i] + (self.cfg.num_kv_heads, self.kv_replicas, self.cfg.head_dim) + shape[i + 1:]
                array = cut(array.reshape(split), i + 1, 0, 1).reshape(
                    shape[:i] + (self.cfg.num_kv_heads * self.cfg.head_dim,) + shape[i + 1:])
        return array

    def _join_quantized(self, qw, logical: tuple[str, ...], fetch):
        from atlasjax.quantization import concat_quantized, slice_quantized  # noqa: PLC0415
        dim = self.split_dim(logical)
        host = {f: None if getattr(qw, f) is None else fetch(getattr(qw, f)) for f in ARRAY_FIELDS}
        devices = range(0, self.size, self.kv_replicas if logical[dim] == "kv_heads" else 1)
        def on(d, x):   # device d's part of a stacked field
            return None if x is None else cut(x, 0, d, d + 1).reshape(x.shape[1:])
        pieces = [dataclasses.replace(qw, **{f: on(d, x) for f, x in host.items()}) for d in devices]
        joined = concat_quantized(pieces, dim)
        if logical[dim] == "vocab" and joined.shape[dim] != self.cfg.vocab_size:   # drop the vocab padding
            joined = slice_quantized(joined, dim, 0, self.cfg.vocab_size)
        return joined

    # ---- shard_map
    def param_specs(self, params: dict, logical_tree: dict):
        """in_specs for the param tree: logical specs; stacked quantized leaves split on their device axis."""
        def walk(node, logical):
            if isinstance(node, dict):
                return {k: walk(v, logical[k]) for k, v in node.items()}
            if is_quantized(node):
                return jax.tree.map(lambda _: P(TP_AXIS), node)
            return self.spec(logical)
        return walk(params, logical_tree)


def _read(reader, transpose: bool):
    array = _local(reader())
    return array.T if transpose else array


def _local(x):
    """x as it is when it is already on a device (so that placing it moves it device to device), else numpy."""
    return x if isinstance(x, jax.Array) else np.asarray(x)


def local_params(params):
    """Inside shard_map: drop the leading device axis of stacked per-device quantized weights."""
    return jax.tree.map(lambda q: jax.tree.map(lambda leaf: leaf[0], q) if is_quantized(q) else q,
                        params, is_leaf=is_quantized)


def lora_specs(layers: dict) -> dict:
    """PartitionSpecs of the runner's LoRA stacks (atlasjax/lora.py: a [slots, in, R], b [slots, R, out] per
    projection), split as their weights are: a row-parallel projection's a over its inputs (its x @ a is a partial
    sum, all-reduced in models/layers.py), a column-parallel one's b over its outputs; the rest replicated."""
    from atlasjax.lora import ROW_PARALLEL  # noqa: PLC0415
    return {layer: {module: {linear: ({"a": P(None, TP_AXIS, None), "b": P()} if linear in ROW_PARALLEL
                                      else {"a": P(), "b": P(None, None, TP_AXIS)})
                             for linear in linears}
                    for module, linears in modules.items()}
            for layer, modules in layers.items()}


class ShardedModel:
    """A Transformer whose `apply` runs per device inside shard_map (same call signature; with LoRA, the "lora"
    collection and each token's adapter slot pass through, split by `lora_specs`)."""

    def __init__(self, model, plan: TensorParallel, param_specs):
        self.model = model
        self.plan = plan
        self.param_specs = {"params": param_specs}

    def __repr__(self) -> str:   # what the program store keys a step on (atlasjax/program_store.py)
        return f"ShardedModel({self.model!r}, {self.plan!r}, {self.param_specs!r})"

    def apply(self, variables, *args, method=None):
        mesh, kv_spec = self.plan.mesh, P(TP_AXIS)
        if method is None:   # forward: (tokens, positions, kv_caches, meta[, lora_ids]) -> (hidden, kv_caches)
            tokens, positions, kv, meta, *lora_ids = args
            kv_specs = jax.tree.map(lambda _: kv_spec, kv)
            specs = dict(self.param_specs)
            if "lora" in variables:
                specs["lora"] = lora_specs(variables["lora"])

            def forward(v, kv, rest):
                local = dict(v, params=local_params(v["params"]))
                return self.model.apply(local, rest[0], rest[1], kv, rest[2], *rest[3:])
            aux = (P(),) if getattr(self.model, "aux_layers", ()) else ()   # an EAGLE-3 head's features
            return jax.shard_map(forward, mesh=mesh, in_specs=(specs, kv_specs, P()),
                                 out_specs=(P(), kv_specs, *aux), check_vma=False)(
                {k: variables[k] for k in specs}, kv, (tokens, positions, meta, *lora_ids))

        def other(v, rest):
            return self.model.apply({"params": local_params(v["params"])}, *rest, method=method)
        return jax.shard_map(other, mesh=mesh, in_specs=(self.param_specs, P()), out_specs=P(),
                             check_vma=False)(variables, args)


class Replicated:
    """A module run whole on every device of a mesh (inside shard_map, its params, operands and results replicated):
    an EAGLE-3 head beside a tensor-parallel target (`apply` as flax's)."""

    def __init__(self, module, mesh):
        self.module = module
        self.mesh = mesh

    def __repr__(self) -> str:   # what the program store keys a step on
        return f"Replicated({self.module!r}, {dict(self.mesh.shape)!r})"

    def apply(self, variables, *args, method=None):
        def run(v, rest):
            return self.module.apply(v, *rest, method=method)
        return jax.shard_map(run, mesh=self.mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)(variables, args)


@functools.cache
def logical_axes(cfg, dtype) -> dict:
    """path tree -> logical axis names of every parameter (from the model's own annotations).
    Cached: loading, the runner and presets all ask for it; callers must not mutate it."""
    from models.transformer import abstract_params  # noqa: PLC0415
    boxed = abstract_params(cfg, dtype)
    return jax.tree.map(lambda b: tuple(b.names), boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly multi-process) array as numpy; a collective across processes
    when other processes hold some of its shards."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils  # noqa: PLC0415
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
