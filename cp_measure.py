"""Context parallel measured (ring_attention.py): the formulas for the bytes one rank sends per attention
layer and the arithmetic on the ring's schedule (matmul FLOPs, useful scores), and one forward + backward
of any method on a seeded batch that measures its collectives (CommCounter), FLOPs (FlopCounterMode),
peak memory (MemTracker), time and the ring's waits from outside. The demo, the tests and the notebook
compare the one with the other; the lesson itself is ring_attention.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from instruments import CommCounter, memory_tracker, time_calls, time_steps
from ring_attention import LAYOUTS, ContextParallelAttention, RingPass, chunk_ids, ring_schedule, shard_sequence


# ---- the formulas the measurements are compared with ---------------------------------------------

def ring_bytes(B, c, Hkv, D, cp, b):
    """Bytes one rank sends per ring-attention layer: (forward, backward)."""
    block, acc = 2 * B * c * Hkv * D, max(b, 4)     # the dk, dv accumulators are fp32 (float64 stays)
    return (cp - 1) * block * b, (cp - 1) * block * b + (cp if cp > 1 else 0) * block * acc


def ulysses_bytes(B, c, H, Hkv, D, cp, b):
    """API bytes of the two all-to-alls per layer, each way."""
    return 0 if cp == 1 else B * c * (H + 2 * (Hkv if Hkv % cp == 0 else H)) * D * b + B * c * H * D * b


def schedule_work(cp, rank, layout, causal, B, H, c, D) -> dict:
    """Arithmetic on ring_schedule: matmul FLOPs of the forward (QKᵀ and PV: 4·B·H·cq·ck·D per block
    pair, whole blocks) and backward (5 matmuls: 10·B·H·cq·ck·D), and the useful (unmasked) scores."""
    n = len(chunk_ids(layout, cp, rank))
    pairs = [d for _, _, ps in ring_schedule(cp, rank, layout, causal) for _, _, d in ps]
    cq = c // n
    return dict(fwd=4 * B * H * cq * cq * D * len(pairs), bwd=10 * B * H * cq * cq * D * len(pairs),
                scores=B * H * sum(cq * (cq + 1) // 2 if d else cq * cq for d in pairs))


# ---- one forward + backward, measured from outside (tests, notebook and demo call these on every rank) ----

def seeded_inputs(B, S, H, Hkv, D, dtype, seed, device=None, round_to=None, q_scale=1.0):
    """The seeded global q, k, v [B, h, S, D] and output gradient, the same on every rank (round_to: first
    rounded to that dtype — the exact answer for bf16 inputs — q_scale: q multiplied, scores grow)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, h, S, D, generator=gen, dtype=torch.float64) * (q_scale if i == 0 else 1)
          for i, h in enumerate((H, Hkv, Hkv, H))]
    return [x.to(round_to or dtype).to(device, dtype) for x in xs]


def attention_case(B=2, S=32, H=4, Hkv=2, D=8, causal=True, method="ring", layout="zigzag", dtype=torch.float64,
                   seed=0, group=None, ring_group=None, repeats=0, memory=False, device=None, q_scale=1.0):
    """One forward + backward on this rank's shard of a seeded global batch: its shards of out, dq, dk, dv,
    the collectives (CommCounter) and matmul FLOPs (FlopCounterMode) of forward and backward; optionally peak
    memory (MemTracker), the median time of `repeats` calls and the forward's waits for the next block.
    On a group of one, "ulysses" is PyTorch's SDPA on the whole sequence: the single-process reference."""
    group = group or dist.group.WORLD
    attn = ContextParallelAttention(group, method, layout, causal, ring_group)
    rank = dist.get_rank(group) + (0 if ring_group is None else dist.get_rank(ring_group) * dist.get_world_size(group))
    q, k, v, dout = (shard_sequence(t, attn.cp, rank, layout, dim=2).requires_grad_(i < 3)      # [B, h, S/cp, D]
                     for i, t in enumerate(seeded_inputs(B, S, H, Hkv, D, dtype, seed, device, q_scale=q_scale)))
    with CommCounter() as fwd, FlopCounterMode(display=False) as ffl:
        out = attn(q, k, v)
    with CommCounter() as bwd, FlopCounterMode(display=False) as bfl:
        out.backward(dout)
    res = dict(out=out.detach(), dq=q.grad.clone(), dk=k.grad.clone(), dv=v.grad.clone(),
               flops=(ffl.get_total_flops(), bfl.get_total_flops()), calls=(fwd.summary(), bwd.summary()),
               bytes=tuple(c.bytes("send") + c.bytes("all_to_all") for c in (fwd, bwd)))
    step = lambda: attn(q, k, v).backward(dout)  # noqa: E731
    if memory:
        with memory_tracker() as mt:
            step()
        res["peak_bytes"] = mt.get_tracker_snapshot("peak")[q.device]["Total"]
    if repeats:   # every rank starts each call at once: the time is the ring's, not a straggler's
        res["time"] = time_steps(lambda: (dist.barrier(), step()), repeats)
        with torch.no_grad(), time_calls(RingPass, "wait") as waits:      # blocked: the next block not there yet
            time_steps(lambda: (dist.barrier(), attn(q, k, v)), repeats, warmup=0)
        res["wait"] = sum(waits) / repeats
    return res


def sweep(seq_lens, layouts=LAYOUTS, **shape) -> dict:
    """Rank function (a cp group of the whole world): per layout and S, this rank's peak ring-attention
    memory (forward + backward) and the forward's matmul FLOPs."""
    return {layout: [(r["peak_bytes"], r["flops"][0]) for r in (
        attention_case(S=S, layout=layout, dtype=torch.float32, memory=True, **shape) for S in seq_lens)]
        for layout in layouts}
