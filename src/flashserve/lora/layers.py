"""LoRA adapters on the device, applied beside the native model's fused projections.

`LoRAStack` holds `max_loras` slots of adapter weights for every layer and fused projection
(qkv, o, gate_up, down), each slot's rank padded to `max_lora_rank` with zeros. Per projection
the slots are stacked into one shrink matrix `A` [S * n * R, in] (n: the projections fused, 3
for qkv, 2 for gate_up) and one expand matrix `B` [out, S * n * R], in which q's (k's, v's) block
of a slot writes only q's (k's, v's) rows of the fused output. A step's delta is then two dense
GEMMs whatever adapters its rows use:

    u = x @ A.T                       # [T, S*n*R]: every slot's shrink
    u *= mask                         # zero the slots a row does not use (mask [T, S], one-hot)
    y = y + u @ B.T                   # [T, out]: the expand, q/k/v (gate/up) into their slices,
                                      # added into the projection's output by the GEMM (addmm)

Rows of the base model have an all-zero mask. The mask comes from the step's per-token slot
index (`token_slots`, int64 [T], 0 = no adapter, s + 1 = slot s), which the runner writes into
one persistent buffer: a CUDA graph captured over the buffer's first rows replays with the slots
of the step that replays it. The cost is (in + out) * S * n * R per token, against in * out for
the base projection: at 8B with 4 slots of rank 16 about 4% of the projection's FLOPs (qkv 8%,
the others 2-4%), and the slots' bytes are read once a step. With LoRA off the model holds no
stack and its forward is unchanged; an eager step whose rows are all the base model's skips it.

On a GPU the masked GEMMs are launches, not bytes: on an H200 under a CUDA graph each projection's
three kernels took 10-13 us whatever the rows (1..128), and the 8B's decode step of 32 rows went
from 6.115 ms to 8.30 (1.36x) with one adapter or four. So a CUDA step of bfloat16 / float16
weights with few rows (decode steps, their graphs; `TRITON_MAX_TOKENS` per projection) runs two
Triton kernels instead (`triton_lora`, Punica's shrink and expand): each row reads only its own
slot's A, and only its own module's R columns of B (q's rows of the fused output use q's block of
the slot), slots no row uses are skipped and base rows are neither read nor written, the slot
index read on the device from the same persistent buffer. Larger steps keep the masked GEMMs,
which the Triton kernels' cost, growing with the rows, passes between 8 and 128 rows.

    H200, lora_bench: 8B decode step of 32 rows    masked GEMMs       Triton kernels (every
    at kv 1024 from CUDA graphs, ms (x base)                          projection)
      base model, LoRA off                         5.981              -
      base rows (the graph without adapters)       6.082 (1.017x)     the same graph
      1 adapter                                    8.228 (1.376x)     7.658 (1.280x)
      1 adapter, a stack of 1 slot                 -                  7.566 (1.265x)
      4 adapters                                   8.159 (1.364x)     8.009 (1.339x)
    one projection's delta at 32 rows (us)         11.7-13.4          6.3-14.3
    FlashInfer's SegmentGEMMWrapper: 36-580 us a projection; a gather + bmm 14-180.

On a CPU, where steps run eagerly and the slot index is on the host already, a step whose
adapters each have several tokens runs per segment instead: each adapter's rows through its own
slot's A and B (`_SEGMENT_MIN_TOKENS`). Measured on the embedded SmolLM2-135M's shapes (30
layers, 4 slots of rank 16, one thread of a loaded 2-core EPYC): 8 decode rows over 4 adapters,
masked 63 ms against 98 per segment; over 1 adapter 70 against 26; 64 rows over 4 adapters 161
against 106; 512 rows 943 against 485. A gather of each row's weights and a bmm was slower in
every case (202, 177, 1416 ms).

Tensor parallelism (PEFT's layout, A [r, in] and B [out, r]): a column-parallel projection
(q, k, v, gate, up) keeps the whole A and its rows of B; a row-parallel one (o, down) keeps its
columns of A and the whole B, and its partial delta joins the projection's partial output
before the all-reduce (`B (sum_r A_r x_r) = sum_r B A_r x_r`). The rows and columns are those
of `distributed/sharding.py`, zero-padded alike.
"""

from __future__ import annotations

from typing import Any

import torch

from flashserve.distributed.sharding import ShardLayout
from flashserve.lora import triton_lora
from flashserve.lora.adapter import LoRAAdapter

Tensor = torch.Tensor

__all__ = ["FUSED", "LoRAStack"]

# The native model's fused projections and the adapter modules each fuses, in output order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}  # fmt: skip
# `ShardLayout.slice_for`'s kind of each module.
_SHARD_KIND = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
               "down_proj": "down"}  # fmt: skip
_ROW_PARALLEL = ("o_proj", "down_proj")
# A CPU step runs per segment when every adapter it uses has this many tokens on average, or it
# uses one adapter (see the module docstring's measurements).
_SEGMENT_MIN_TOKENS = 8
# Step tokens whose slot index lives in the persistent buffer (what CUDA graphs capture); a
# larger (prefill) step gets a tensor of its own.
DEFAULT_TOKEN_CAPACITY = 8192
# The rows up to which a CUDA step of bfloat16 / float16 weights runs each projection's Triton
# kernels (`triton_lora`); more rows, the masked GEMMs. The largest row count measured where the
# Triton kernels were faster (H200, lora_bench's kernel table, Llama-3.1-8B, 4 slots of rank 16,
# 1/8/32/128/256 rows): qkv 7.5 against 12.6 us at 32 rows, 14.1 against 13.5 at 128; o 12.6
# against 12.8 at 128, 19.8 against 13.6 at 256; gate_up 11.4 against 12.7 at 8, 14.3 against 13.4
# at 32; down 9.7 against 12.2 at 32, 25.7 against 13.2 at 128.
TRITON_MAX_TOKENS = {"qkv": 32, "o": 128, "gate_up": 8, "down": 32}


class LoRAStack:
    """The device slots of one rank's model. `spec`: the whole model's `LlamaSpec`; `shard`: the
    rank's layout (whole on one rank)."""

    def __init__(self, spec: Any, shard: ShardLayout, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str, token_capacity: int = DEFAULT_TOKEN_CAPACITY) -> None:  # fmt: skip
        self.num_slots, self.max_rank = max_loras, max_rank
        self.shard = shard
        self.dtype, self.device = dtype, torch.device(device)
        rs = shard.rank_spec(spec)
        q, kv, h, i = rs.num_heads * rs.head_dim, rs.num_kv_heads * rs.head_dim, rs.hidden_size, rs.intermediate_size
        # (in, out rows of each fused module) per projection, on this rank.
        self.shapes: dict[str, tuple[int, tuple[int, ...]]] = {
            "qkv": (h, (q, kv, kv)), "o": (q, (h,)), "gate_up": (h, (i, i)), "down": (i, (h,)),
        }  # fmt: skip
        self.a: dict[str, list[Tensor]] = {}
        self.b: dict[str, list[Tensor]] = {}
        for kind, (in_f, outs) in self.shapes.items():
            cols = max_loras * len(outs) * max_rank
            self.a[kind] = [torch.zeros(cols, in_f, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]
            self.b[kind] = [torch.zeros(sum(outs), cols, dtype=dtype, device=self.device)
                            for _ in range(spec.num_layers)]  # fmt: skip
        self.slot_ids = torch.arange(1, max_loras + 1, dtype=torch.long, device=self.device)
        self._slots_buffer = torch.zeros(token_capacity, dtype=torch.long, device=self.device)
        # Per projection, the steps of up to this many tokens that run the Triton kernels (0: none
        # do), which write their float32 partials into one scratch buffer.
        self.triton_rows = dict.fromkeys(self.shapes, 0)
        self._partials: Tensor | None = None
        if self.device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and triton_lora.available():
            self.set_triton_rows({k: min(n, token_capacity) for k, n in TRITON_MAX_TOKENS.items()})
        self._large: Tensor | None = None
        self.mask: Tensor | None = None  # [T, S] of the forward running now (`begin`)
        # A CPU step's (slot, its token rows; None: every row) when it runs per segment.
        self.segments: list[tuple[int, Tensor | None]] | None = None
        # Whether the step has rows of an adapter; an eager step of the base model alone skips the
        # stack. A decode graph is captured with it on, so that its replays apply any slots.
        self.active = False

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for ts in (*self.a.values(), *self.b.values()) for t in ts)

    # The slots' weights.

    def write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Places `adapter` (whole-model host weights, scaling folded into B) in `slot`: this rank's
        share of each module's A and B, cast to the model dtype, the rest of the slot zeroed."""
        self.clear_slot(slot)
        r = adapter.rank
        for kind, modules in FUSED.items():
            n = len(modules)
            base = slot * n * self.max_rank
            outs = self.shapes[kind][1]
            for j, module in enumerate(modules):
                col, row = base + j * self.max_rank, sum(outs[:j])
                for layer in range(len(self.a[kind])):
                    ab = adapter.weights.get((layer, module))
                    if ab is None:
                        continue
                    a, b = self._rank_share(module, *ab)
                    self.a[kind][layer][col : col + r].copy_(a)
                    self.b[kind][layer][row : row + outs[j], col : col + r].copy_(b)

    def _rank_share(self, module: str, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        piece = self.shard.slice_for(_SHARD_KIND[module])
        if piece is None:
            return a, b
        return (piece.take(a), b) if module in _ROW_PARALLEL else (a, piece.take(b))

    def clear_slot(self, slot: int) -> None:
        for kind, (_, outs) in self.shapes.items():
            width = len(outs) * self.max_rank
            for layer in range(len(self.a[kind])):
                self.a[kind][layer][slot * width : (slot + 1) * width].zero_()
                self.b[kind][layer][:, slot * width : (slot + 1) * width].zero_()

    # A step's rows.

    def set_step(self, token_slots: Tensor, active: bool) -> None:
        """The step's slot index per token (int64 [T] on the device; 0: the base model, s + 1: slot
        s), copied into the persistent buffer when it fits. `active`: some row uses an adapter."""
        t = token_slots.shape[0]
        self.segments = self._segments(token_slots) if active and token_slots.device.type == "cpu" else None
        if t <= self._slots_buffer.shape[0]:
            self._slots_buffer[:t].copy_(token_slots, non_blocking=True)
            self._large = None
        else:
            self._large = token_slots
        self.active = active

    @staticmethod
    def _segments(token_slots: Tensor) -> list[tuple[int, Tensor | None]] | None:
        used = [int(s) for s in torch.unique(token_slots).tolist() if s]
        if len(used) != 1 and token_slots.shape[0] < _SEGMENT_MIN_TOKENS * len(used):
            return None  # a few tokens over several adapters: the masked GEMMs are faster
        if len(used) == 1 and bool((token_slots == used[0]).all()):
            return [(used[0] - 1, None)]
        return [(s - 1, (token_slots == s).nonzero().squeeze(1)) for s in used]

    def token_slots(self, num_tokens: int) -> Tensor:
        """The slot index of the forward's `num_tokens` tokens (a view of the persistent buffer)."""
        if num_tokens <= self._slots_buffer.shape[0]:
            return self._slots_buffer[:num_tokens]
        assert self._large is not None and self._large.shape[0] == num_tokens, "set_step before a large step"
        return self._large

    def set_triton_rows(self, rows: dict[str, int]) -> None:
        """Which steps run the Triton kernels, per projection (`TRITON_MAX_TOKENS`), and their
        scratch buffer sized for the largest."""
        self.triton_rows = {k: rows.get(k, 0) for k in self.shapes}
        most = max(self.triton_rows.values())
        width = max(len(outs) for _, outs in self.shapes.values()) * self.max_rank
        self._partials = torch.empty(triton_lora.partials_numel(most, width), dtype=torch.float32,
                                     device=self.device) if most else None  # fmt: skip

    def begin(self, num_tokens: int) -> None:
        """Builds the forward's row mask [T, S] from the step's slot index (no host sync), for a
        step the masked GEMMs apply to some projection (the Triton kernels read the slot index
        itself)."""
        self.mask = None if num_tokens <= min(self.triton_rows.values()) else self._build_mask(num_tokens)

    def _build_mask(self, num_tokens: int) -> Tensor:
        return (self.token_slots(num_tokens).unsqueeze(1) == self.slot_ids).to(self.dtype)

    def uses_triton(self, x: Tensor, y: Tensor, kind: str) -> bool:
        """Whether `apply` runs the Triton kernels on these rows of projection `kind` (a CUDA step
        of up to `triton_rows[kind]` rows in the stack's dtype, each row's values contiguous)."""
        return (x.shape[0] <= self.triton_rows[kind] and x.dtype == y.dtype == self.dtype and x.is_cuda
                and x.stride(-1) == 1 and y.stride(-1) == 1)  # fmt: skip

    def apply(self, layer: int, kind: str, x: Tensor, y: Tensor) -> Tensor:
        """`y` [T, out], the output of projection `kind` of `layer` on `x` [T, in], plus the
        adapters' delta. `y` is the projection's own fresh output: it may be updated in place."""
        if self.segments is not None:
            return self._apply_by_segment(layer, kind, x, y, self.segments)
        if self.uses_triton(x, y, kind):
            return self._apply_triton(layer, kind, x, y)
        return self._apply_masked(layer, kind, x, y)

    def _apply_triton(self, layer: int, kind: str, x: Tensor, y: Tensor) -> Tensor:
        assert self._partials is not None, "the Triton kernels need a CUDA stack of bfloat16 / float16 weights"
        return triton_lora.add_lora(x, y, self.a[kind][layer], self.b[kind][layer], self.token_slots(x.shape[0]),
                                    self.num_slots, self.max_rank, self.shapes[kind][1], self._partials)  # fmt: skip

    def _apply_masked(self, layer: int, kind: str, x: Tensor, y: Tensor) -> Tensor:
        mask = self.mask
        if mask is None or mask.shape[0] != x.shape[0]:  # a step `begin` left to the Triton kernels (a test's call)
            mask = self._build_mask(x.shape[0])
        u = torch.nn.functional.linear(x, self.a[kind][layer])
        t = u.shape[0]
        u = (u.view(t, self.num_slots, -1) * mask.unsqueeze(-1)).view(t, -1)
        return torch.addmm(y, u, self.b[kind][layer].t())

    def delta(self, layer: int, kind: str, x: Tensor) -> Tensor:
        """The adapters' delta [T, out] alone (what `apply` adds)."""
        return self.apply(layer, kind, x, x.new_zeros(x.shape[0], self.b[kind][layer].shape[0]))

    def _apply_by_segment(self, layer: int, kind: str, x: Tensor, y: Tensor,
                          segments: list[tuple[int, Tensor | None]]) -> Tensor:  # fmt: skip
        a_all, b_all = self.a[kind][layer], self.b[kind][layer]
        width = a_all.shape[0] // self.num_slots
        for slot, rows in segments:
            cols = slice(slot * width, (slot + 1) * width)
            part = x if rows is None else x.index_select(0, rows)
            u = torch.nn.functional.linear(part, a_all[cols])
            if rows is None:
                y.addmm_(u, b_all[:, cols].t())
            else:
                y.index_add_(0, rows, torch.nn.functional.linear(u, b_all[:, cols]))
        return y
