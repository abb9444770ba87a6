"""ring_attention.py's demo and measurements: the formulas for the bytes one rank sends per attention
layer and the arithmetic on the ring's schedule (matmul FLOPs, useful scores); one forward + backward of
any method on a seeded batch that measures its collectives (CommCounter), FLOPs (FlopCounterMode), peak
memory (MemTracker), time and the ring's waits from outside; the tiny model trained with cp ranks
(`train_cp`); and the demo that prints them in one table next to PyTorch's SDPA on the whole sequence.

    torchrun --nproc_per_node 4 ring_attention.py [--seq 512] [--heads 8 --kv-heads 4] [--no-causal]
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

import ring_attention
from ddp import average_gradients
from lab.baseline import TOL64, single_process
from lab.data import get_batch, load_corpus
from lab.instruments import CommCounter, memory_tracker, time_calls, time_steps
from lab.launch import finish, main as run_main, parse
from lab.model import build_model, get_config
from lab.report import all_agree, print0
from mesh import init_distributed
from ring_attention import (LAYOUTS, ContextParallelAttention, RingPass, check_layout, chunk_ids, ring_schedule,
                            ring_ulysses_groups, shard_positions, shard_sequence)


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


# ---- training the shared model with cp ranks ----------------------------------------------------------

def train_cp(cfg, batches, group, method="ring", layout="zigzag", lr=1e-3, seed=0, device=None, dtype=torch.float32):
    """Train the shared model, each rank holding S/cp tokens of every sequence. Returns the global
    losses and the trained model (every rank's parameters stay the same)."""
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    cp, rank, S = dist.get_world_size(group), dist.get_rank(group), batches[0][0].shape[1]
    pos, losses = shard_positions(S, cp, rank, layout).to(device), []    # (checks S, before any collective)
    model = build_model(cfg, seed=seed, dtype=dtype, device=device)
    for blk in model.layers:        # (its forward checks the heads, before any collective)
        blk.attn.sdpa = ContextParallelAttention(group, method, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for x, y in batches:
        x, y = (shard_sequence(t, cp, rank, layout).to(device) for t in (x, y))       # [B, S/cp]
        # The global loss is the mean of the ranks' means (equal token counts), so its gradient is the average
        # of the ranks' gradients: lesson 1's average over cp. The ring's backward already sent dk, dv home.
        loss = model(x, y, positions=pos)
        loss.backward()
        average_gradients(model.parameters(), group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item() / cp)
    return losses, model


# ---- the demo: torchrun --nproc_per_node 4 ring_attention.py -------------------------------------------

def demo(argv=None) -> int:
    """One table: every method per rank against PyTorch's SDPA on all of S on one rank (error, FLOPs, memory,
    waits, time, bytes against the formula), and the tiny model trained on cp ranks against one process."""
    ap = argparse.ArgumentParser(description=ring_attention.__doc__.splitlines()[0])
    for name, default in [("batch", 1), ("seq", 512), ("heads", 8), ("kv-heads", 4), ("head-dim", 32), ("repeats", 3),
                          ("model-steps", 3), ("q-scale", 1.0)]:
        ap.add_argument(f"--{name}", type=type(default), default=default)
    ap.add_argument("--no-causal", action="store_true")
    a = parse(ap, argv)  # (+ --watch, --patience)
    cp, B, H, Hkv, D = int(os.environ.get("WORLD_SIZE", "1")), a.batch, a.heads, a.kv_heads, a.head_dim
    check_layout(a.seq, cp, "zigzag")                           # arithmetic, before any collective
    if H % Hkv or a.repeats < 1:
        raise ValueError(f"--heads {H} must be a multiple of --kv-heads {Hkv}, --repeats at least 1")
    device, rank, world = init_distributed(), dist.get_rank(), dist.group.WORLD
    alone = [dist.new_group([r]) for r in range(cp)][rank]     # a "ring" of one: the same kernel on all of S
    U = 2 if cp >= 4 and cp % 2 == 0 else 1                    # ring x Ulysses: R = cp/2 rings of U = 2
    ring, uly = ring_ulysses_groups([list(range(cp))], U) if U > 1 else (None, None)
    shape = dict(B=B, S=a.seq, H=H, Hkv=Hkv, D=D, causal=not a.no_causal, dtype=torch.float32, device=device,
                 q_scale=a.q_scale, repeats=a.repeats, memory=True)
    ref = attention_case(**shape, method="ulysses", layout="contiguous", group=alone)    # SDPA, all of S
    rows = [("PyTorch SDPA, 1 rank", "ulysses", "contiguous", 1, 1, alone, None),   # name, method, layout,
            ("ring kernel, 1 rank", "ring", "contiguous", 1, 1, alone, None),       # cp, Ulysses size U,
            ("ring contiguous", "ring", "contiguous", cp, 1, world, None),          # group, ring group
            ("ring zigzag", "ring", "zigzag", cp, 1, world, None),
            ("ulysses contiguous", "ulysses", "contiguous", cp, cp, world, None),
            (f"ring {cp // U} x ulysses {U} zigzag", "ulysses", "zigzag", cp, U, uly, ring)][:5 + (U > 1)]
    w = 6 * max(cp, 4) + 1
    print0(f"cp={cp} ranks, B={B} S={a.seq} heads={H} kv_heads={Hkv} head_dim={D} {'full' if a.no_causal else 'causal'}"
           f" fp32, q x {a.q_scale:g}, {device}\n{'':26s}{'rel. err':>9s}  {'fwd MFLOP per rank':{w}s}"
           f"{'peak MiB per rank':{w}s}{'waits ms per rank':{w}s}{'ms':>6s}  bytes/layer fwd+bwd (formula)")
    ok = True
    for name, method, layout, n, u, group, ring_group in rows:
        if H % u:
            print0(f"  ({name} skipped: {H} heads are not divisible by {u})")
            continue
        res = ref if group is alone and method == "ulysses" else attention_case(
            **shape, method=method, layout=layout, group=group, ring_group=ring_group)
        err = torch.stack([(res[x] - shard_sequence(ref[x], n, rank % n, layout, dim=2)).abs().max() / ref[x].abs().max()
                           for x in ("out", "dq", "dk", "dv")]).max()
        every = [torch.tensor([err, res["flops"][0] / 1e6, res["peak_bytes"] / 2**20, res["wait"] * 1e3,
                               res["time"]], device=device) for _ in range(cp)]   # [5] per rank: all-gathered
        dist.all_gather(every, every[rank].clone())
        err, (flops, peak, wait, ms) = torch.stack(every)[:, 0].max().item(), torch.stack(every)[:, 1:].T.tolist()
        hkv, c = Hkv if Hkv % u == 0 else H, a.seq // n     # (Ulysses repeats kv heads it cannot split)
        formula = sum(ring_bytes(B, u * c, hkv // u, D, n // u, 4)) + 2 * ulysses_bytes(B, c, H, Hkv, D, u, 4)
        ok &= err < 1e-4 and sum(res["bytes"]) == formula
        cells = [" ".join(f"{x:.{p}f}" for x in xs) if show else "-"     # SDPA's matmuls: not counted on CPU
                 for xs, p, show in ((flops, 1, method == "ring" or u < n), (peak, 2, True), (wait, 1, u < n))]
        print0(f"  {name:26s}{err:7.1e}  " + "".join(f"{x:{w}s}" for x in cells)
               + f"{max(ms) * 1e3:6.1f}  {sum(res['bytes']):,d} ({formula:,d})")
    # Trained in float64, where equal means rounding (TOL64); lab/baseline.py says why fp32 after AdamW is not
    batches = [get_batch(load_corpus(), s, 2, 32, device=device) for s in range(a.model_steps)]
    want = single_process(build_model("tiny", dtype=torch.float64, device=device), batches)["losses"]
    for method, layout in [("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "zigzag")][:2 + (4 % cp == 0)]:
        losses, _ = train_cp("tiny", batches, world, method, layout, device=device, dtype=torch.float64)
        diff = max(abs(x - y) for x, y in zip(losses, want))
        ok &= diff < TOL64
        print0(f"  {'train ' + method + ' ' + layout:26s}{diff:7.1e}  (tiny model, {a.model_steps} AdamW steps in "
               f"float64: max |loss - one process's|, within {TOL64:.0e})")
    ok = all_agree(ok)
    print0("all checks", "ok" if ok else "FAILED")
    return finish(ok)


def main(argv=None) -> None:
    run_main(demo, argv)
