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
from 6.1 ms to 8.3 (1.35x) with one adapter or four. So on a GPU (bfloat16 / float16 weights, the
Triton kernels of `triton_lora`) the shrink joins the projection's own GEMM (`fuse_shrink`): each
projection's weight is stored with every slot's A stacked under it, [out + S n R (padded), in],
the model's weight a view of its first rows, so the GEMM the projection runs anyway also gives u
for S n R more output columns (the 8B's qkv 6,144 -> 6,400 rows, 0.3-1.5 us more at 1-32 tokens).
A step with adapters then adds one kernel a projection: the expand, which reads each row's own
slot's columns of u and of B (slots no row uses are not read), adds them to the projection's
output and writes the result (base rows unchanged) into a fresh tensor; for gate_up it applies
SiLU-and-mul too (`project`'s silu_and_mul), so the model's own SiLU-and-mul kernel does not run. Steps
of up to `FUSED_TRITON_MAX_TOKENS` rows (decode steps, their graphs) take the kernel, larger ones
the mask and one addmm on the same u. FP8 weights keep the shrink apart (`apply`: the Triton
shrink and expand kernels up to `TRITON_MAX_TOKENS` rows, else the masked GEMMs).

    H200, lora_bench: 8B decode step of 32 rows at kv 1024, CUDA graphs, rank 16, ms (x base; the
    median of 5 interleaved rounds)
      base model, LoRA off                           6.113
      base rows (the graph without adapters)         6.147 (1.005x)
      shrink in the GEMM + expand (SiLU) kernel      1 adapter 6.714 (1.098x), 4 adapters 6.751 (1.104x)
      Triton shrink + expand kernels, apart          1 adapter 8.089 (1.323x), 4 adapters 8.302 (1.358x)
      masked GEMMs                                   1 adapter 8.256 (1.351x), 4 adapters 8.254 (1.350x)
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

from typing import Any, Callable

import torch

from flashserve.distributed.sharding import ShardLayout
from flashserve.layers.linear import LinearArgs, linear
from flashserve.lora import triton_lora
from flashserve.lora.adapter import LoRAAdapter

Tensor = torch.Tensor

__all__ = ["FUSED", "PROJECTION", "LoRAStack"]

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
# The same where the shrink is part of the projection's GEMM (`fuse_shrink`): the expand kernel
# (for gate_up with SiLU-and-mul: `project`) against the mask and one addmm, what each adds
# to the projection (H200, lora_bench, 1..128 rows over 4 slots of rank 16: at 128 rows qkv 8.5
# against 12.0 us, o 5.6 against 8.8, gate_up 13.9 against 20.2 + the model's SiLU-and-mul, down
# 5.6 against 11.0; larger steps were not measured and keep the masked GEMMs).
FUSED_TRITON_MAX_TOKENS = {"qkv": 128, "o": 128, "gate_up": 128, "down": 128}
# The rows of a projection's weight with its slots' A under it (`fuse_shrink`) are zero-padded to
# a multiple of this: cuBLAS's tiles of 128 output columns. On an H200, 8B down_proj (4,096 rows)
# at 8 / 32 tokens: 32.7 / 33.8 us alone, 34.6 / 35.5 with 64 rows of A, 33.4 / 34.3 padded to
# 4,224; qkv (6,336 or 6,400) and gate_up (28,800 or 28,928) within 0.5 us either way.
FUSED_ROWS_MULTIPLE = 128
# The decoder layer's attribute holding each fused projection.
PROJECTION = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


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
        # Per projection and layer, its weight with every slot's A stacked under it (and its bias
        # with zeros), when `fuse_shrink` made the two one matrix; None: apart.
        self.fused: dict[str, list[tuple[Tensor, Tensor | None]]] | None = None
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

    def fuse_shrink(self, layers: Any) -> bool:
        """Stacks each projection's slots of A under its weight in one matrix (the projection's
        weight and `a` become views of it), so that a step's shrink is the projection's own GEMM,
        `S n R` rows longer, and a projection's adapters cost one kernel more (the expand,
        `project`). For dense weights of the stack's dtype (`layers`: the model's decoder layers;
        `enable_lora` asks it where the Triton kernels run); returns whether it was done."""
        projections = [[getattr(layer, PROJECTION[kind]) for layer in layers] for kind in self.shapes]
        if self.fused is not None or any(p.weight.dtype != self.dtype or p.weight.device != self.device
                                         or p.weight.is_mkldnn for ps in projections for p in ps):  # fmt: skip
            return False
        self.fused = {}
        for kind, ps in zip(self.shapes, projections):
            self.fused[kind] = []
            for i, proj in enumerate(ps):
                out_f, a = proj.weight.shape[0], self.a[kind][i]
                pad = -(out_f + a.shape[0]) % FUSED_ROWS_MULTIPLE
                ext = torch.cat([proj.weight.data, a, a.new_zeros(pad, a.shape[1])])
                proj.weight = torch.nn.Parameter(ext[:out_f], requires_grad=False)
                self.a[kind][i] = ext[out_f : out_f + a.shape[0]]
                bias = None
                if proj.bias is not None:
                    bias = torch.cat([proj.bias.data, proj.bias.new_zeros(a.shape[0] + pad)])
                    proj.bias = torch.nn.Parameter(bias[:out_f], requires_grad=False)
                self.fused[kind].append((ext, bias))
        if self.device.type == "cuda":  # the replaced weights' blocks, before the KV cache is sized
            torch.cuda.empty_cache()
        self.set_triton_rows({k: min(n, self._slots_buffer.shape[0]) for k, n in FUSED_TRITON_MAX_TOKENS.items()})
        return True

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

    def project(self, layer: int, kind: str, x: Tensor, args: LinearArgs,
                silu_and_mul: Callable[[Tensor], Tensor] | None = None) -> Tensor:  # fmt: skip
        """Projection `kind` of `layer` (`args`: its `Linear.args`) on `x` [T, in], plus the
        adapters' delta: with the shrink in the projection's GEMM (`fuse_shrink`), that GEMM and the
        expand; otherwise the projection, then `apply`. `silu_and_mul` (gate_up): applied to the
        result, by the expand kernel itself where it runs (the gate_up output never written whole)."""
        apart = self.fused is None or self.segments is not None or x.dtype != self.dtype
        fused = None if apart else self.fused[kind][layer]  # type: ignore[index]
        if fused is None:
            y = self.apply(layer, kind, x, linear(x, *args))
        else:
            out_f = args[0].shape[0]
            y_ext = torch.nn.functional.linear(x, *fused)
            if self.uses_triton(x, y_ext, kind):
                slots, b = self.token_slots(x.shape[0]), self.b[kind][layer]
                if silu_and_mul is not None:
                    return triton_lora.add_lora_fused_silu(y_ext, out_f // 2, b, slots, self.num_slots, self.max_rank)
                return triton_lora.add_lora_fused(y_ext, out_f, b, slots, self.num_slots, self.max_rank,
                                                  self.shapes[kind][1])  # fmt: skip
            u = y_ext[:, out_f : out_f + self.a[kind][layer].shape[0]].unflatten(1, (self.num_slots, -1))
            u = u * self._row_mask(x.shape[0]).unsqueeze(-1)
            y = torch.addmm(y_ext[:, :out_f], u.flatten(1), self.b[kind][layer].t())
        return y if silu_and_mul is None else silu_and_mul(y)

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
        u = torch.nn.functional.linear(x, self.a[kind][layer])
        t = u.shape[0]
        u = (u.view(t, self.num_slots, -1) * self._row_mask(t).unsqueeze(-1)).view(t, -1)
        return torch.addmm(y, u, self.b[kind][layer].t())

    def _row_mask(self, num_tokens: int) -> Tensor:
        """The forward's row mask [T, S] (`begin`'s, or built now for a step `begin` left to the
        Triton kernels: a test's call)."""
        mask = self.mask
        return mask if mask is not None and mask.shape[0] == num_tokens else self._build_mask(num_tokens)

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
