"""The Triton LoRA kernels of decode-sized GPU steps (`lora/triton_lora.py`) on a CPU, through
Triton's interpreter: each row gets its own adapter's delta and base rows are left alone.

The interpreter must be on before Triton is first imported, so the check runs in a process of
its own (this file as a script, `TRITON_INTERPRET=1`). float16 weights: the interpreter's
bfloat16 products are wrong (its bfloat16 dot returns garbage), so bfloat16 is the GPU test's
(`tests/gpu/test_lora_gpu.py`). Small shapes chosen so that output blocks straddle the fused
modules (q|k, gate|up), slots of ranks 16, 8, 16 and 4 (padded to 16), and steps of 1, 7 and 70
rows (two row blocks) over four slots and base rows. Reference: the masked GEMMs of a float32
stack of the same adapters; per adapter row the delta's relative error must be under 1e-2
(float16 rounding of x, A, B and of y + delta, y of the delta's size). The same for the expand
after a shrink joined to the projection's GEMM (`add_lora_fused`: y and u from one product), and
for gate_up its SiLU-and-mul variant against silu(gate + delta) * (up + delta) in float32.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

RANKS = (16, 8, 16, 4)
STEPS = {1: [3], 7: [1, 0, 3, 2, 0, 4, 1], 70: [(3 * i) % 5 for i in range(70)]}


def check(fused: bool) -> None:
    from flashserve.distributed.sharding import ShardLayout
    from flashserve.lora import triton_lora
    from flashserve.lora.adapter import LoRAAdapter, module_shapes
    from flashserve.lora.layers import LoRAStack

    # The shape fields of a `LlamaSpec`: q 96 and k, v 32 rows (a 64-column block holds q's last
    # and k's first), gate and up 100.
    spec = SimpleNamespace(num_layers=1, hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=16,
                           intermediate_size=100, vocab_size=256)  # fmt: skip
    stacks = {dtype: LoRAStack(spec, ShardLayout.for_spec(spec, 0, 1), len(RANKS), max(RANKS), dtype, "cpu")
              for dtype in (torch.float32, torch.float16)}  # fmt: skip
    for slot, rank in enumerate(RANKS):
        gen = torch.Generator().manual_seed(slot)
        weights = {(0, m): (torch.randn(rank, i, generator=gen) * 0.1, torch.randn(o, rank, generator=gen) * 0.1)
                   for m, (o, i) in module_shapes(spec).items()}  # fmt: skip
        for stack in stacks.values():
            stack.write_slot(slot, LoRAAdapter(slot + 1, f"a{slot}", rank, 1.0, weights))
    ref, half = stacks[torch.float32], stacks[torch.float16]
    partials = torch.empty(triton_lora.partials_numel(max(STEPS), 3 * max(RANKS)))
    gen = torch.Generator().manual_seed(0)
    for rows, slots in STEPS.items():
        token_slots = torch.tensor(slots)
        ref.set_step(token_slots, True)
        ref.begin(rows)
        adapted = token_slots > 0
        for kind, (in_f, outs) in half.shapes.items():
            x = torch.randn(rows, in_f, generator=gen)
            y = torch.randn(rows, sum(outs), generator=gen).half()
            expected = ref.delta(0, kind, x)
            if fused:  # y and every slot's shrink from one product, then the expand into a fresh output
                u = torch.nn.functional.linear(x.half(), half.a[kind][0])
                got = triton_lora.add_lora_fused(torch.cat([y, u], dim=1), sum(outs), half.b[kind][0], token_slots,
                                                 len(RANKS), max(RANKS), outs)  # fmt: skip
            else:
                got = triton_lora.add_lora(x.half(), y.clone(), half.a[kind][0], half.b[kind][0], token_slots,
                                           len(RANKS), max(RANKS), outs, partials)  # fmt: skip
            assert torch.equal(got[~adapted], y[~adapted]), (kind, rows, "base rows changed")
            delta = got.float() - y.float()
            err = (delta - expected).norm(dim=1)[adapted] / expected.norm(dim=1)[adapted]
            assert (err < 1e-2).all(), (kind, rows, err)
            if fused and kind == "gate_up":  # the same expand with SiLU-and-mul after it, in one kernel
                inter = outs[0]
                act = triton_lora.add_lora_fused_silu(torch.cat([y, u], dim=1), inter, half.b[kind][0], token_slots,
                                                      len(RANKS), max(RANKS))  # fmt: skip
                full = y.float() + torch.where(adapted[:, None], expected, 0.0)
                want = torch.nn.functional.silu(full[:, :inter]) * full[:, inter:]
                torch.testing.assert_close(act.float(), want, atol=2e-3, rtol=2e-3)


def interpret(*argv: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_triton_lora_kernels_give_each_row_its_adapters_delta_on_the_cpu_interpreter() -> None:
    interpret()


def test_the_expand_after_a_shrink_joined_to_the_projections_gemm_gives_each_row_its_adapters_delta() -> None:
    """`add_lora_fused`: the projection's output and every slot's shrink in one product's columns
    (`LoRAStack.fuse_shrink`); each row gets its own slot's delta, base rows their output's bits."""
    interpret("fused")


if __name__ == "__main__":
    check(fused=sys.argv[1:] == ["fused"])
