"""LoRA adapters, vLLM's way: PEFT adapters chosen per request, several of them (and the base model) in one batch.

    llm = LLM(model, enable_lora=True, max_loras=2, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

An adapter is a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`) whose LoRA pairs touch the
decoder's linear projections (q/k/v/o, gate/up/down). The engine keeps `max_loras` device slots; the runner's
`lora` tree (atlasjax/lora_slots.py) holds, for each projection, a stack `a` [max_loras, in, R] and `b`
[max_loras, R, out] beside the weights (R = max_lora_rank x the projection's parts: a fused q/k/v or gate/up
projection puts its parts' A matrices side by side and their B matrices block-diagonally, so one pair of
matmuls serves the group). The scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into b; a smaller
rank, and a projection an adapter leaves out, are zeros. `adapter_of_slot` [max_num_seqs] gives each engine
slot's LoRA slot (-1: the base model).

Each linear layer then adds, per token, `(x @ a[slot]) @ b[slot]` (models/layers.py `lora_delta`: the products
with every slot, masked to the token's, so the step keeps its fixed shapes). Adapters are read and checked on the
host when a request names them (kept for `max_cpu_loras` adapters), and written to a free device slot when a
request using them is admitted; a slot is reused once no running request uses its adapter. A request waits while
every slot holds another adapter in use, and requests behind it with a placed adapter go first. Cached prompt
pages are keyed by adapter (`Request.cache_root`), so requests share prefixes only under the same adapter.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re

import numpy as np

from atlasjax import hub
from atlasjax.errors import EngineConfigError, InvalidRequestError

# the projections LoRA applies to, in output order within a fused one: PEFT / HF module name -> (module, the
# runner's fused projection holding it; models/fused.py GROUPS, which this module may not import: it stays jax-free)
PROJECTIONS = {"q_proj": ("self_attn", "qkv_proj"), "k_proj": ("self_attn", "qkv_proj"),
               "v_proj": ("self_attn", "qkv_proj"), "o_proj": ("self_attn", "o_proj"),
               "gate_proj": ("mlp", "gate_up_proj"), "up_proj": ("mlp", "gate_up_proj"),
               "down_proj": ("mlp", "down_proj")}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.\w+)?\.weight$")
MAX_RANK = 512


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A request's adapter (vLLM's LoRARequest): a name, a positive integer id and the PEFT directory."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def check_config(enable_lora, max_loras, max_lora_rank, max_cpu_loras) -> None:
    """EngineConfig's LoRA settings (raises EngineConfigError)."""
    if not isinstance(enable_lora, bool):
        raise EngineConfigError(f"enable_lora must be True or False, got {enable_lora!r}")
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
    if max_lora_rank > MAX_RANK:
        raise EngineConfigError(f"max_lora_rank must be at most {MAX_RANK}, got {max_lora_rank}")
    if max_cpu_loras is not None and (isinstance(max_cpu_loras, bool) or not isinstance(max_cpu_loras, int)
                                      or max_cpu_loras < max_loras):
        raise EngineConfigError(f"max_cpu_loras must be an integer >= max_loras ({max_loras}), got {max_cpu_loras!r}")


ROW_PARALLEL = ("o_proj", "down_proj")   # under tensor parallelism: split over their inputs (atlasjax/sharding.py)


@dataclasses.dataclass(frozen=True)
class Target:
    """One linear layer of the runner's params that LoRA applies to: its path, input width and parts (HF name,
    output width) in output order."""
    path: tuple[str, str, str]
    in_features: int
    parts: tuple[tuple[str, int], ...]

    @property
    def out_features(self) -> int:
        return sum(width for _, width in self.parts)

    @property
    def row_parallel(self) -> bool:
        return self.path[2] in ROW_PARALLEL


@dataclasses.dataclass(frozen=True)
class DeviceSplit:
    """How the runner's weights are split over devices (tensor parallelism; one device: `DeviceSplit()`): a
    column-parallel projection's columns are laid out device by device, each device's part slices in part order
    (models/fused.py), and a k/v part with fewer heads than devices gives device d its head d // kv_replicas."""
    shards: int = 1
    kv_replicas: int = 1
    head_dim: int = 0

    def column_blocks(self, t: Target) -> list[tuple[int, int, int]]:
        """(part index, first column, end column) of t's parts in the order of its (global) output columns."""
        if t.row_parallel or self.shards == 1:
            return [(p, 0, width) for p, (_, width) in enumerate(t.parts)]
        blocks = []
        for d in range(self.shards):
            for p, (name, width) in enumerate(t.parts):
                if name in ("k_proj", "v_proj") and self.kv_replicas > 1:
                    head = d // self.kv_replicas
                    blocks.append((p, head * self.head_dim, (head + 1) * self.head_dim))
                else:
                    w = width // self.shards
                    blocks.append((p, d * w, (d + 1) * w))
        return blocks

    def out_features(self, t: Target) -> int:
        return sum(stop - start for _, start, stop in self.column_blocks(t))


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) features on one device."""
    q, kv, hidden, mlp = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp), "down_proj": (mlp, hidden)}


def targets(params: dict, cfg) -> list[Target]:
    """The linear layers of `params` (the runner's execution layout: fused or not, per layer) LoRA applies to."""
    shapes = projection_shapes(cfg)
    out = []
    for layer in sorted((k for k in params if k.startswith("layers_")), key=lambda k: int(k.split("_")[1])):
        for module in ("self_attn", "mlp"):
            for linear, leaves in params[layer][module].items():
                # a fused projection's parts, or the projection itself (unfused, or o_proj / down_proj)
                parts = tuple(p for p, (m, fused) in PROJECTIONS.items() if m == module and linear in (fused, p))
                if parts and "kernel" in leaves:
                    out.append(Target((layer, module, linear), shapes[parts[0]][0],
                                      tuple((p, shapes[p][1]) for p in parts)))
    return out


@dataclasses.dataclass(eq=False)
class Adapter:
    """An adapter read from its PEFT directory: per (layer index, projection) its A [r, in] and its B [out, r]
    with the scaling folded in (float32)."""
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    def slot_arrays(self, layout: list[Target], max_rank: int, dtype, split: DeviceSplit = DeviceSplit()) -> dict:
        """{layer: {module: {linear: {"a": [in, P * max_rank], "b": [P * max_rank, out]}}}}: what one device slot
        holds for this adapter (zeros where it has no pair); b's columns in the order of the weight's (`split`)."""
        tree: dict = {}
        for t in layout:
            a = np.zeros((t.in_features, len(t.parts) * max_rank), np.float32)
            b = np.zeros((len(t.parts) * max_rank, split.out_features(t)), np.float32)
            layer = int(t.path[0].split("_")[1])
            for p, (name, _) in enumerate(t.parts):
                if (layer, name) in self.weights:
                    lora_a = self.weights[(layer, name)][0]
                    a[:, p * max_rank:p * max_rank + lora_a.shape[0]] = lora_a.T
            column = 0
            for p, start, stop in split.column_blocks(t):
                if (layer, t.parts[p][0]) in self.weights:
                    lora_b = self.weights[(layer, t.parts[p][0])][1]
                    b[p * max_rank:p * max_rank + lora_b.shape[1], column:column + stop - start] = lora_b[start:stop].T
                column += stop - start
            tree.setdefault(t.path[0], {}).setdefault(t.path[1], {})[t.path[2]] = {
                "a": a.astype(dtype), "b": b.astype(dtype)}
        return tree


def read_adapter(request: LoRARequest, cfg, max_rank: int) -> Adapter:
    """The adapter of `request` read from its directory and checked against the model (InvalidRequestError
    naming what is wrong: a missing or unreadable file, LoRA on layers other than the projections, DoRA, a rank
    above max_rank, shapes that do not fit the model)."""
    path = request.lora_path
    def bad(msg):
        raise InvalidRequestError(f"LoRA adapter {request.lora_name!r} ({path}): {msg}")
    try:
        path = hub.resolve(path, "LoRA adapter")      # a Hub id ("org/adapter") as vLLM takes one
    except EngineConfigError as e:
        bad(str(e))
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        bad("no adapter_config.json there (a PEFT adapter directory is expected)")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        bad(f"adapter_config.json is unreadable: {e}")
    if not isinstance(config, dict):
        bad("adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        bad(f"peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (full weights beside the LoRA)"),
                     ("alpha_pattern", "per-module alpha (alpha_pattern)"),
                     ("layers_to_transform", "layers_to_transform"), ("fan_in_fan_out", "fan_in_fan_out")):
        if config.get(key):
            bad(f"{why} is not supported")
    if config.get("bias", "none") != "none":
        bad(f"LoRA biases (bias={config.get('bias')!r}) are not supported")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        bad("no adapter_model.safetensors there (adapters saved as .bin must be converted to safetensors)")
    try:
        from safetensors.numpy import load_file  # noqa: PLC0415
        tensors = load_file(weights_file)
    except Exception as e:   # a truncated or corrupt file: the request fails, the engine does not
        bad(f"adapter_model.safetensors is unreadable: {e}")
    alpha = config.get("lora_alpha", config.get("r", 8))
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = collections.defaultdict(dict)
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None or m[3] not in PROJECTIONS or PROJECTIONS[m[3]][0] != m[2]:
            bad(f"tensor {key!r} is not a LoRA pair of a decoder projection (q/k/v/o, gate/up/down); LoRA on "
                "embeddings or the LM head is not supported")
        pairs[(int(m[1]), m[3])][m[4]] = value.astype(np.float32)
    if not pairs:
        bad("adapter_model.safetensors holds no LoRA weights")
    shapes = projection_shapes(cfg)
    weights = {}
    for (layer, name), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            bad(f"layer {layer} {name} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[name]
        if layer >= cfg.num_layers or a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out \
                or a.shape[0] != b.shape[1]:
            bad(f"layer {layer} {name}: lora_A {a.shape} and lora_B {b.shape} do not fit the model (the layer's "
                f"weight is [{fan_out}, {fan_in}], it has {cfg.num_layers} layers); was it trained for another model?")
        r = a.shape[0]
        if r > max_rank:
            bad(f"rank {r} exceeds the engine's max_lora_rank={max_rank} (raise it: LLM(..., max_lora_rank=...))")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        weights[(layer, name)] = (a, b * scale)
    return Adapter(weights)


class LoRAManager:
    """Which adapter each device slot holds and which running requests use it (the scheduler asks `can_place`,
    `acquire` and `release` as it admits and frees requests); the adapters read so far, on the host."""

    def __init__(self, runner, cfg, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None):
        self.runner, self.cfg = runner, cfg
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.layout = targets(runner.params, cfg)
        plan = runner.plan
        self.split = DeviceSplit() if plan is None else DeviceSplit(plan.size, plan.kv_replicas, cfg.head_dim)
        from atlasjax.lora_slots import LoRASlots  # noqa: PLC0415 (this module stays jax-free to import)
        runner.lora_slots = LoRASlots(self.layout, max_loras, max_lora_rank, self.split, runner.dtype,
                                      runner.max_num_seqs, plan)
        self._host: collections.OrderedDict[str, tuple[LoRARequest, Adapter]] = collections.OrderedDict()
        self.slots: list[LoRARequest | None] = [None] * max_loras   # the adapter each device slot holds
        self.users = [0] * max_loras                         # running requests using each slot
        self._last_used = [0] * max_loras
        self._clock = 0
        self.num_loads = 0                                    # adapters written to a device slot

    # ---- host side: requests name adapters
    def check(self, request: LoRARequest) -> Adapter:
        """request's adapter, read once (InvalidRequestError if it is unusable) and kept among the most recently
        named `max_cpu_loras`. A name given again with another path or id is read again (a server reloaded it);
        requests admitted with the old one keep it."""
        known = self._host.get(request.lora_name)
        if known is not None and known[0] == request:
            self._host.move_to_end(request.lora_name)
            return known[1]
        adapter = read_adapter(request, self.cfg, self.max_lora_rank)
        self._host[request.lora_name] = (request, adapter)
        for name in list(self._host):
            if len(self._host) <= self.max_cpu_loras:
                break
            if self._host[name][0] not in self.slots:   # a resident adapter stays readable for its next request
                del self._host[name]
        return adapter

    # ---- device slots: the scheduler admits and frees requests
    def can_place(self, req) -> bool:
        """Whether req (its adapter, if any) can run now: its adapter is resident, or a slot is free of users."""
        return req.lora_request is None or req.lora_request in self.slots or 0 in self.users

    def acquire(self, req) -> None:
        """req is admitted: its adapter's slot (written now if it was not resident) gains a user."""
        if req.lora_request is None:
            req.lora_slot = -1
            return
        if req.lora_request in self.slots:
            j = self.slots.index(req.lora_request)
        else:
            free = [j for j in range(self.max_loras) if self.users[j] == 0]
            j = min(free, key=lambda j: (self.slots[j] is not None, self._last_used[j]))   # empty, else least recent
            arrays = req.lora_adapter.slot_arrays(self.layout, self.max_lora_rank, self.runner.dtype, self.split)
            self.runner.lora_slots.write(j, arrays)
            self.slots[j] = req.lora_request
            self.num_loads += 1
        self.users[j] += 1
        self._clock += 1
        self._last_used[j] = self._clock
        req.lora_slot = j

    def release(self, req) -> None:
        """req left its engine slot (finished or preempted)."""
        if req.lora_slot >= 0:
            self.users[req.lora_slot] -= 1
        req.lora_slot = -1

    def assign(self, admitted) -> None:
        """The admitted requests' engine slots now run their LoRA slots (-1: the base model)."""
        self.runner.lora_slots.assign([(req.slot, req.lora_slot) for req in admitted])
