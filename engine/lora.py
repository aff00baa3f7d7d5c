"""Multi-LoRA: adapters by name in host memory, ``max_loras`` slots on the device, and the
per-step batch that the model's projections add their low-rank deltas from.

Every slot holds, per layer and per projection (q/k/v/o, gate/up/down), ``A`` zero-padded to
``[max_rank, in]`` and ``B`` to ``[out, max_rank]`` inside one stacked buffer per projection
(``[layers, slots, ...]``), so one kernel call serves every adapter of a step. A projection an
adapter does not target stays zero in its slot. The projections of one input (q/k/v, and
gate/up: ``LORA_GROUPS``) share their buffers, A stacked along the rank and B in the fused
output's column order, so on CUDA one shrink reads the input once for all of them and one
expand writes the fused output (``kernels.lora_add_fused``: 8 launches per layer, not 14).
Before each step the adapters the step needs are placed in slots (``LoRAManager.prepare``); a
slot the step does not need is reused least recently used first. The scheduler puts at most
``max_loras`` adapters in one step.

Under tensor parallelism each rank keeps its part of every adapter, split as the base layer is
(``engine.parallel.shard.lora_slice``): rows of B for the column-parallel projections, columns
of A for the row-parallel ones. Every rank has the same adapters and makes the same slot
choices, since rank 0 sends it each load, unload and step in order (``ModelRunner``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

import kernels
from engine.config import ModelConfig
from engine.errors import AdapterNotFoundError, InvalidAdapterError
from engine.lora_config import LORA_MODULES, LoRASpec, module_shape, read_spec
from engine.parallel.shard import ModelShard, lora_slice

# Projections of one input whose deltas are computed together, in their fused output's order.
LORA_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",),
)  # fmt: skip
assert sorted(m for g in LORA_GROUPS for m in g) == sorted(LORA_MODULES)


@dataclass(slots=True)
class LoRABatch:
    """One step's adapters: the slot buffers and which slot each token uses."""

    a: dict[str, torch.Tensor]  # module -> [layers, slots, R, in]
    b: dict[str, torch.Tensor]  # module -> [layers, slots, out, R]
    meta: kernels.LoRAMetadata
    modules: frozenset[str]  # projections some adapter of the step targets
    # first module of a group -> the group's stacked A [layers, slots, n * R, in] and B
    # [layers, slots, sum(out), R] (``a``/``b`` of its modules are views of them)
    fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def add(
        self, layer: int, module: str, y: torch.Tensor, x: torch.Tensor,
        choices: kernels.KernelChoices = kernels.KernelChoices(),  # noqa: B008 - frozen
    ) -> None:  # fmt: skip
        """``y += lora(x)`` for ``module`` of ``layer`` (``y`` may be a slice of a fused output;
        ``choices``: the model's)."""
        if module not in self.modules:
            return
        a, b = self.a[module][layer], self.b[module][layer]
        kernels.lora_add(y, x, a, b, self.meta, choices)

    def add_parts(
        self, layer: int, parts: tuple[tuple[str, int], ...], y: torch.Tensor, x: torch.Tensor,
        choices: kernels.KernelChoices = kernels.KernelChoices(),  # noqa: B008 - frozen
    ) -> None:  # fmt: skip
        """``y += lora(x)`` for projections of one input side by side in ``y``'s columns
        (``parts``: each one's name and width, in order): in one fused call where they are a
        group of the buffers (``LORA_GROUPS``), else one call each."""
        names = [m for m, _ in parts]
        if not self.modules.intersection(names):
            return
        stacked = self.fused.get(names[0])
        if stacked is not None and kernels.use_triton(x):
            a, b = stacked
            widths = [w for _, w in parts]
            kernels.lora_add_fused(y, x, a[layer], b[layer], widths, self.meta, choices=choices)
            return
        lo = 0
        for m, width in parts:
            self.add(layer, m, y[:, lo : lo + width], x, choices)
            lo += width


class LoRAManager:
    """Registered adapters (by name) and the device slots they are placed in for a step."""

    def __init__(
        self,
        model: ModelConfig,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        shard: ModelShard | None = None,
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.device, self.dtype = device, dtype
        self.shard = shard or ModelShard.of(model, 1, 0)
        # module -> ("in" or "out", lo, hi): this rank's columns of A or rows of B.
        self.slices = {m: lora_slice(self.shard, m, model.head_dim) for m in LORA_MODULES}
        self.specs: dict[str, LoRASpec] = {}
        self._host: dict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.ranks = [0] * max_loras
        self.scales = [0.0] * max_loras
        # The same scales on the device, updated in place (what decode CUDA graphs read).
        self.scales_t = torch.zeros(max_loras, dtype=torch.float32, device=device)
        L = model.num_layers  # noqa: N806
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for group in LORA_GROUPS:
            shapes = []
            for m in group:
                fan_in, fan_out = module_shape(model, m)
                side, lo, hi = self.slices[m]
                shapes.append((hi - lo, fan_out) if side == "in" else (fan_in, hi - lo))
            fan_in = shapes[0][0]
            if any(i != fan_in for i, _ in shapes):
                raise ValueError(f"the projections {group} do not share their input")
            R = max_rank  # noqa: N806
            a = torch.zeros((L, max_loras, len(group) * R, fan_in), device=device, dtype=dtype)
            b = torch.zeros(
                (L, max_loras, sum(o for _, o in shapes), R), device=device, dtype=dtype
            )
            self.fused[group[0]] = (a, b)
            lo = 0
            for j, (m, (_, fan_out)) in enumerate(zip(group, shapes, strict=True)):
                self.a[m] = a[:, :, j * R : (j + 1) * R]
                self.b[m] = b[:, :, lo : lo + fan_out]
                lo += fan_out

    # -- registry ----------------------------------------------------------------------------
    def add(self, name: str, path: str) -> LoRASpec:
        """Check and read an adapter folder into host memory (InvalidAdapterError says why not)."""
        if name in self.specs:
            raise InvalidAdapterError(f"adapter {name!r} is already loaded")
        spec = read_spec(name, path, self.model, self.max_rank)
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        f = f"{spec.path}/adapter_model.safetensors"
        with safe_open(f, framework="pt") as st:
            for target, (a_name, b_name) in spec.tensor_names.items():
                side, lo, hi = self.slices[target[1]]
                a, b = st.get_slice(a_name), st.get_slice(b_name)
                a = a[:, lo:hi] if side == "in" else a[:]
                b = b[lo:hi] if side == "out" else b[:]
                weights[target] = (a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous())
        self.specs[name], self._host[name] = spec, weights
        return spec

    def remove(self, name: str) -> None:
        """Forget an adapter (the caller made sure no running sequence uses it)."""
        if name not in self.specs:
            raise AdapterNotFoundError(f"the adapter `{name}` is not loaded")
        del self.specs[name], self._host[name]
        self._slot_of.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self.specs)

    def resident(self) -> list[str]:
        """Adapters in device slots, least recently used first."""
        return list(self._slot_of)

    # -- slots -------------------------------------------------------------------------------
    def prepare(self, names: set[str]) -> dict[str, int]:
        """Place every adapter of ``names`` (at most ``max_loras``) in a slot; slot by name."""
        if len(names) > self.max_loras:
            raise ValueError(f"{len(names)} adapters in one step; the limit is {self.max_loras}")
        for name in sorted(names, key=lambda n: n not in self._slot_of):
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
                continue
            self._place(name, self._free_slot(names))
        return {n: self._slot_of[n] for n in names}

    def _free_slot(self, keep: set[str]) -> int:
        used = set(self._slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next(n for n in self._slot_of if n not in keep)  # least recently used
        return self._slot_of.pop(victim)

    def _place(self, name: str, slot: int) -> None:
        if name not in self.specs:
            raise AdapterNotFoundError(f"the adapter `{name}` is not loaded")
        spec = self.specs[name]
        for m in LORA_MODULES:
            self.a[m][:, slot].zero_()
            self.b[m][:, slot].zero_()
        r = spec.rank
        for (layer, m), (a, b) in self._host[name].items():
            self.a[m][layer, slot, :r].copy_(a, non_blocking=True)
            self.b[m][layer, slot, :, :r].copy_(b, non_blocking=True)
        self.ranks[slot], self.scales[slot] = r, spec.scaling
        self.scales_t[slot] = spec.scaling
        self._slot_of[name] = slot

    def token_slots(self, token_adapters: list[str], names: list[str]) -> list[int]:
        """Place the step's adapters ``names`` in slots (``prepare``); then each token's slot,
        from its adapter name ("" or None: the base model, -1)."""
        slots = self.prepare(set(names))
        return [slots[n] if n else -1 for n in token_adapters]

    def batch(self, token_adapters: list[str], slots: dict[str, int]) -> LoRABatch | None:
        """The step's LoRABatch from each token's adapter name ("" for the base), or None when
        no token uses an adapter."""
        if not slots:
            return None
        token_slots = [slots[n] if n else -1 for n in token_adapters]
        meta = kernels.LoRAMetadata.build(token_slots, self.ranks, self.scales, self.device)
        modules = frozenset().union(*(self.specs[n].modules for n in slots))
        return LoRABatch(self.a, self.b, meta, modules, self.fused)

    def graph_batch(
        self, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor
    ) -> LoRABatch:
        """A LoRABatch over fixed-size tile tables (``kernels.reference.lora_tile_table``)
        that the caller refills each step, and the slots' scales as they are at each use: what
        a decode CUDA graph captures. Every projection takes its delta (a slot's untargeted
        projections are zero, and add exact zeros)."""
        meta = kernels.LoRAMetadata(
            self.ranks, self.scales, [], rows, starts, lens, slots, self.scales_t
        )
        return LoRABatch(self.a, self.b, meta, frozenset(LORA_MODULES), self.fused)
