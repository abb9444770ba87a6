"""Lesson 6 — context parallel: ring attention (contiguous and zigzag) and Ulysses.

The idea
--------
Context parallel (cp) cuts the *sequence* of every batch into cp shards, one per rank.
Everything in a transformer is token-wise except attention, and attention needs every
key and value. Two ways to give it them:

Ring attention (Liu et al.): each rank keeps its queries; the key/value blocks travel
around a ring of cp ranks. At step t rank r holds the block of rank (r - t) mod cp,
computes its queries against it (while the next block is already on the wire) and folds
the result into its running output with the log-sum-exp rule (online softmax):
    lse' = lse - logsigmoid(lse - lse_b)          out' = out - sigmoid(lse_b - lse)·(out - out_b)
exact, overflow-free, accumulated in fp32. The backward runs the ring again: k/v blocks
travel with their gradient accumulators dk, dv, which end one hop later at their owner.
Under a causal mask a contiguous split is unbalanced: rank r attends to r+1/2 blocks'
worth of keys. The zigzag layout cuts the sequence into 2·cp chunks and gives rank i
chunks i and 2·cp-1-i, so every rank does the same work.

Ulysses (DeepSpeed): one all-to-all turns sequence shards of all heads into full
sequences of H/cp heads; attention runs locally; a second all-to-all turns them back.
Needs heads divisible by cp (key/value heads too, or they are repeated up to H).

Communication per attention layer, per rank (c = S/cp tokens held, d_kv = H_kv·D, b bytes
per element, times the batch B; THEORY.md "Ring attention"):
    ring forward     (cp-1) · 2·c·d_kv·b                  k, v passed on cp-1 times
    ring backward    (cp-1) · 2·c·d_kv·b + cp · 2·c·d_kv·4   k, v again + fp32 dk, dv going home
                     (float64 inputs: 8 for 4, the accumulators stay float64)
    Ulysses forward  all-to-all of c·(H+2·H_kv)·D·b  and of c·H·D·b (each sends (cp-1)/cp of it);
                     the backward: the same two, reversed.
Memory per rank: q, k, v, output O(S/cp) instead of O(S); the ring computes scores one
block at a time, [B, H, S/cp, S/cp] (zigzag: [B, H, S/2cp, S/2cp]) instead of [B, H, S, S].
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from instruments import CommCounter, memory_tracker, time_steps
from mesh import Mesh, init_distributed, print0

LAYOUTS = ("contiguous", "zigzag")
METHODS = ("ring", "ulysses")


# ---- layouts: which chunks of the sequence each rank holds ---------------------------

def chunk_ids(layout: str, cp: int, rank: int) -> list[int]:
    """The sequence chunks rank `rank` holds: contiguous cuts S into cp chunks, zigzag into 2·cp."""
    return [rank] if layout == "contiguous" else [rank, 2 * cp - 1 - rank]


def check_layout(seq_len: int, cp: int, layout: str) -> None:
    """Raise ValueError (on every rank alike: pure arithmetic) unless S splits into the layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} unknown: choose one of {LAYOUTS}")
    n = cp if layout == "contiguous" else 2 * cp
    if seq_len % n:
        raise ValueError(f"sequence length {seq_len} is not divisible by {n} ({layout} layout, cp={cp} "
                         f"needs {'cp' if n == cp else '2·cp'} equal chunks): use a multiple of {n}")


def shard_sequence(x: torch.Tensor, cp: int, rank: int, layout: str, dim: int = 1) -> torch.Tensor:
    """This rank's part of x along the sequence dimension `dim` ([B, S] -> [B, S/cp])."""
    check_layout(x.shape[dim], cp, layout)
    chunks = x.chunk(cp if layout == "contiguous" else 2 * cp, dim)
    return torch.cat([chunks[i] for i in chunk_ids(layout, cp, rank)], dim)


def gather_sequence(shards: list[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """Inverse of shard_sequence: the shards of ranks 0..cp-1 back into the full sequence."""
    cp = len(shards)
    chunks = {}
    for r, s in enumerate(shards):
        ids = chunk_ids(layout, cp, r)
        chunks.update(zip(ids, s.chunk(len(ids), dim)))
    return torch.cat([chunks[i] for i in sorted(chunks)], dim)


def shard_positions(seq_len: int, cp: int, rank: int, layout: str) -> torch.Tensor:
    """Absolute positions of the tokens this rank holds (rotary needs them, not 0..S/cp-1)."""
    return shard_sequence(torch.arange(seq_len), cp, rank, layout, dim=0)


# ---- one block of attention, by hand, in fp32, returning the log-sum-exp ---------------

def _expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GQA: kv head j serves query heads j·g .. j·g+g-1 (as SDPA's enable_gqa)."""
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def _causal_mask(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)  # True above the diagonal: masked


def block_forward(q, k, v, scale, diagonal):
    """q [B, H, cq, D], k, v [B, Hkv, ck, D] -> out [B, H, cq, D], lse [B, H, cq].
    diagonal: the query and key chunks are the same chunk, so the causal triangle applies."""
    s = q @ _expand_kv(k, q.shape[1]).transpose(-2, -1) * scale            # [B, H, cq, ck]
    if diagonal:
        s = s.masked_fill(_causal_mask(s.shape[-1], s.device), float("-inf"))
    lse = s.logsumexp(-1)                                                    # [B, H, cq]
    return torch.exp(s - lse[..., None]) @ _expand_kv(v, q.shape[1]), lse


def block_backward(q, k, v, do, lse, delta, scale, diagonal):
    """Gradients of one block, FlashAttention-style: P is recomputed from the FINAL lse of
    each query row, so P here is the true softmax restricted to this block, and
    dS = P ∘ (dP − rowsum(dO ∘ O)) needs only delta = rowsum(dO ∘ O), not the other blocks."""
    H, Hkv = q.shape[1], k.shape[1]
    ke, ve = _expand_kv(k, H), _expand_kv(v, H)
    s = q @ ke.transpose(-2, -1) * scale
    if diagonal:
        s = s.masked_fill(_causal_mask(s.shape[-1], s.device), float("-inf"))
    p = torch.exp(s - lse[..., None])                                        # [B, H, cq, ck]
    dv = p.transpose(-2, -1) @ do                                            # [B, H, ck, D]
    ds = p * (do @ ve.transpose(-2, -1) - delta[..., None])
    dq = ds @ ke * scale
    dk = ds.transpose(-2, -1) @ q * scale
    fold = lambda g: g.unflatten(1, (Hkv, H // Hkv)).sum(2)                 # noqa: E731  [B, Hkv, ck, D]
    return dq, fold(dk), fold(dv)


def merge(out, lse, block_out, block_lse):
    """Fold one block into the running (out, lse) — the stable online-softmax rule."""
    if out is None:
        return block_out, block_lse
    new_lse = lse - F.logsigmoid(lse - block_lse)
    return out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out), new_lse


def block_pairs(q_ids, k_ids, causal):
    """(i, j, diagonal) for the (query chunk, key chunk) pairs that are not fully masked."""
    for i, qc in enumerate(q_ids):
        for j, kc in enumerate(k_ids):
            if not causal or kc <= qc:
                yield i, j, causal and kc == qc


def new_work(log: bool = False) -> dict:
    """Attention work a rank actually did (forward): block kernels, FLOPs computed, useful score
    entries, and seconds spent waiting for the next block (communication not hidden, or a slower neighbour)."""
    return dict(blocks=0, flops=0, scores=0, wait_s=0.0, log=[] if log else None)  # log: (phase, step, q, k)


def _count(work, phase, step, qc, kc, q, k, diagonal):
    if work is None:
        return
    B, H, cq, D = q.shape
    ck = k.shape[2]
    if work["log"] is not None:
        work["log"].append((phase, step, qc, kc))
    if phase == "fwd":
        work["blocks"] += 1
        work["flops"] += 4 * B * H * cq * ck * D                    # QK^T and PV, 2 FLOPs per multiply-add
        work["scores"] += B * H * (cq * (cq + 1) // 2 if diagonal else cq * ck)  # unmasked entries


# ---- the ring -------------------------------------------------------------------------

class _Pass:
    """Send tensors to the next rank and receive the same shapes from the previous one,
    asynchronously: start it, compute, then wait()."""

    def __init__(self, tensors, group):
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        nxt, prv = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
        self.sent = [t.contiguous() for t in tensors]  # kept alive until the sends finish
        self.bufs = [torch.empty_like(t) for t in self.sent]
        ops = [dist.P2POp(dist.isend, t, nxt, group) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, b, prv, group) for b in self.bufs]
        self.reqs = dist.batch_isend_irecv(ops)  # one batch: no pair of neighbours can deadlock

    def wait(self):
        for r in self.reqs:
            r.wait()
        return self.bufs


class RingAttention(torch.autograd.Function):
    """q [B, H, c, D], k, v [B, Hkv, c, D] (this rank's shard, in `layout`) -> out [B, H, c, D]."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal, work):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        wd = torch.promote_types(q.dtype, torch.float32)        # fp32 accumulation (float64 stays)
        scale = q.shape[-1] ** -0.5
        my_ids = chunk_ids(layout, cp, rank)
        n = len(my_ids)
        qs = q.to(wd).chunk(n, dim=2)                            # n x [B, H, c/n, D]
        outs, lses = [None] * n, [None] * n
        kb, vb = k, v                                            # the block in hand travels in its own dtype
        for t in range(cp):
            src = (rank - t) % cp                                # whose block we hold now
            nxt = _Pass([kb, vb], group) if t < cp - 1 else None  # the next block travels while we compute
            ks, vs = kb.to(wd).chunk(n, dim=2), vb.to(wd).chunk(n, dim=2)
            src_ids = chunk_ids(layout, cp, src)
            for i, j, diag in block_pairs(my_ids, src_ids, causal):
                bo, bl = block_forward(qs[i], ks[j], vs[j], scale, diag)
                outs[i], lses[i] = merge(outs[i], lses[i], bo, bl)
                _count(work, "fwd", t, my_ids[i], src_ids[j], qs[i], ks[j], diag)
            if nxt is not None:
                t0 = time.perf_counter()
                kb, vb = nxt.wait()
                if work is not None:
                    work["wait_s"] += time.perf_counter() - t0
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)   # [B, H, c, D] fp32, [B, H, c]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.causal, ctx.work = group, layout, causal, work
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, causal = ctx.group, ctx.layout, ctx.causal
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        wd, scale = out.dtype, q.shape[-1] ** -0.5
        my_ids = chunk_ids(layout, cp, rank)
        n = len(my_ids)
        do = dout.to(wd)
        delta = (do * out).sum(-1)                               # rowsum(dO ∘ O)  [B, H, c]
        qs, dos, lses, deltas = (x.chunk(n, dim=2) for x in (q.to(wd), do, lse, delta))
        dq = torch.zeros_like(q, dtype=wd)
        dqs = dq.chunk(n, dim=2)                                 # views: += writes into dq
        kb, vb, acc = k, v, None
        for t in range(cp):
            src = (rank - t) % cp
            nxt = _Pass([kb, vb], group) if t < cp - 1 else None
            ks, vs = kb.to(wd).chunk(n, dim=2), vb.to(wd).chunk(n, dim=2)
            dk_part = torch.zeros_like(kb, dtype=wd)             # this step's contribution to block src
            dv_part = torch.zeros_like(vb, dtype=wd)
            dks, dvs = dk_part.chunk(n, dim=2), dv_part.chunk(n, dim=2)
            src_ids = chunk_ids(layout, cp, src)
            for i, j, diag in block_pairs(my_ids, src_ids, causal):
                g_q, g_k, g_v = block_backward(qs[i], ks[j], vs[j], dos[i], lses[i], deltas[i], scale, diag)
                dqs[i].add_(g_q)
                dks[j].add_(g_k)
                dvs[j].add_(g_v)
                _count(ctx.work, "bwd", t, my_ids[i], src_ids[j], qs[i], ks[j], diag)
            # the accumulator of block src arrived from the previous rank (who added its part)
            dk_acc, dv_acc = (dk_part, dv_part) if acc is None else [a + p for a, p in
                                                                     zip(acc.wait(), (dk_part, dv_part))]
            # ... and goes on to the next rank: it holds block src next step, or owns it after the last
            acc = _Pass([dk_acc, dv_acc], group) if cp > 1 else None
            if nxt is not None:
                kb, vb = nxt.wait()
        dk, dv = acc.wait() if acc is not None else (dk_acc, dv_acc)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


# ---- Ulysses: all-to-all from sequence shards to head shards and back ------------------

class _AllToAll(torch.autograd.Function):
    """Split x into cp pieces along scatter_dim, piece j to rank j; concatenate what arrives
    along gather_dim. Its backward is the same exchange with the two dimensions swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        cp = dist.get_world_size(group)
        if cp == 1:
            return x
        send = torch.stack(x.chunk(cp, dim=scatter_dim)).contiguous()   # [cp, ...]: row j goes to rank j
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)                  # row i came from rank i
        return torch.cat(recv.unbind(0), dim=gather_dim)

    @staticmethod
    def backward(ctx, g):
        scatter_dim, gather_dim = ctx.dims
        return _AllToAll.apply(g, ctx.group, gather_dim, scatter_dim), None, None, None


def check_ulysses(n_heads: int, cp: int) -> None:
    if n_heads % cp:
        raise ValueError(f"Ulysses gives each of the cp={cp} ranks n_heads/cp heads, but n_heads={n_heads} "
                         f"is not divisible by {cp}: choose cp from "
                         f"{[d for d in range(1, n_heads + 1) if n_heads % d == 0]} or use ring attention")


def ulysses_attention(q, k, v, group, layout, causal):
    """q [B, H, c, D], k, v [B, Hkv, c, D] sequence shards -> out [B, H, c, D]."""
    cp = dist.get_world_size(group)
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv % cp:                       # GQA with fewer kv heads than ranks: repeat them up to H
        k, v = _expand_kv(k, H), _expand_kv(v, H)
    hq, hkv = H // cp, k.shape[1] // cp
    # one all-to-all for q, k, v: group heads by destination rank, [B, cp·(hq+2hkv), c, D]
    qkv = torch.cat([t.unflatten(1, (cp, -1)) for t in (q, k, v)], dim=2).flatten(1, 2)
    qkv = _AllToAll.apply(qkv, group, 1, 2)                        # [B, hq+2hkv, S, D] in shard order
    order = [i for r in range(cp) for i in chunk_ids(layout, cp, r)]  # chunk held at each place
    inverse = sorted(range(len(order)), key=order.__getitem__)
    qkv = qkv.unflatten(2, (len(order), -1))[:, :, inverse].flatten(2, 3)  # natural token order
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)  # [B, hq, S, D]
    o = o.unflatten(2, (len(order), -1))[:, :, order].flatten(2, 3)      # back to shard order
    return _AllToAll.apply(o, group, 2, 1)                             # [B, H, c, D]


# ---- the module that takes the place of block.attn.sdpa ------------------------------

class ContextParallelAttention(nn.Module):
    """Attention over a sequence sharded across `group` (the model's rotary already used
    the shard's absolute positions). method "ring" or "ulysses"; layout "contiguous" or "zigzag"."""

    def __init__(self, group, method: str = "ring", layout: str = "zigzag", causal: bool = True, log=False):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method {method!r} unknown: choose one of {METHODS}")
        check_layout(2 * dist.get_world_size(group), dist.get_world_size(group), layout)
        self.group, self.method, self.layout, self.causal = group, method, layout, causal
        self.work = new_work(log)  # counters of what this rank's ring computed (and the blocks, if log)

    def forward(self, q, k, v):
        cp = dist.get_world_size(self.group)
        # every check is arithmetic on shapes all ranks share: it raises before any collective
        check_layout(q.shape[2] * cp, cp, self.layout)
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")
        if self.method == "ulysses":
            check_ulysses(q.shape[1], cp)
            return ulysses_attention(q, k, v, self.group, self.layout, self.causal)
        return RingAttention.apply(q, k, v, self.group, self.layout, self.causal, self.work)


def ring_bytes(B, c, Hkv, D, cp, b):
    """Formula: bytes one rank sends per ring-attention layer (forward, backward)."""
    block = 2 * B * c * Hkv * D
    acc = max(b, 4)  # the dk, dv accumulators are fp32 (float64 stays float64)
    return (cp - 1) * block * b, (cp - 1) * block * b + (cp if cp > 1 else 0) * block * acc


def ulysses_bytes(B, c, H, Hkv, D, cp, b):
    """Formula: API bytes of the two all-to-alls per layer (forward; the backward is the same)."""
    hkv = Hkv if Hkv % cp == 0 else H
    return 0 if cp == 1 else B * c * (H + 2 * hkv) * D * b + B * c * H * D * b


# ---- training the shared model with cp ranks ---------------------------------------------

def train_cp(cfg, batches, group, method="ring", layout="zigzag", lr=1e-3, seed=0, device=None):
    """Train the shared model, each rank holding S/cp tokens of every sequence. Returns the
    global losses and the trained model (every rank's parameters stay identical)."""
    from model import build_model, get_config
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    S = batches[0][0].shape[1]
    check_layout(S, cp, layout)          # before any collective, on every rank alike
    if method == "ulysses":
        check_ulysses(cfg.n_heads, cp)
    model = build_model(cfg, seed=seed, device=device)
    for blk in model.layers:
        blk.attn.sdpa = ContextParallelAttention(group, method, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    pos = shard_positions(S, cp, rank, layout).to(device)
    losses = []
    for x, y in batches:
        x, y = (shard_sequence(t, cp, rank, layout).to(device) for t in (x, y))   # [B, S/cp]
        loss = model(x, y, positions=pos)
        # global loss = mean over ranks of the local means (equal token counts); the ring's
        # backward already sent each rank's dk, dv home, so summing the ranks' parameter
        # gradients of loss/cp gives the gradient of the global mean. (An MoE aux loss is not a
        # mean of per-rank parts: this lesson trains the dense model.) The all-reduce over cp is
        # the data-parallel one of lesson 1; torchtitan folds cp into its dp_shard_cp group.
        (loss / cp).backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=group)
        for g, f in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(f.view_as(g))
        opt.step()
        opt.zero_grad(set_to_none=True)
        l = loss.detach().clone()
        dist.all_reduce(l, group=group)
        losses.append(l.item() / cp)
    return losses, model


# ---- measured runs (the tests, the notebook and the demo call these on every rank) ------

def _inputs(B, S, H, Hkv, D, dtype, seed, device=None, round_to=None):
    """The seeded global q, k, v [B, h, S, D] and output gradient, the same on every rank
    (round_to: first rounded to that dtype, e.g. the exact answer for bf16 inputs)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, h, S, D, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv, H)]
    return [x.to(round_to or dtype).to(device, dtype) for x in xs]


def _measure(res, step, device, memory, repeats, group=None):
    """Peak memory of one forward+backward (MemTracker: everything it allocates) and median time."""
    if memory:
        with memory_tracker() as mt:
            step()
        res["peak_bytes"] = mt.get_tracker_snapshot("peak")[device]["Total"]
    if repeats:   # ranks start each call together, so the time is the ring's, not a straggler's
        res["time"] = time_steps(lambda: (group is None or dist.barrier(group=group), step()), repeats)
    return res


def attention_case(B=2, S=32, H=4, Hkv=2, D=8, causal=True, method="ring", layout="zigzag",
                   dtype=torch.float64, seed=0, group=None, repeats=0, memory=False, device=None):
    """One forward + backward of context-parallel attention on this rank's shard of a seeded
    global batch: this rank's shards of out, dq, dk, dv, its work, the bytes it sent
    (forward, backward), and optionally its peak attention memory and the time per call."""
    group = group or dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout = (shard_sequence(t, cp, rank, layout, dim=2)          # [B, h, S/cp, D]
                     for t in _inputs(B, S, H, Hkv, D, dtype, seed, device))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attn = ContextParallelAttention(group, method, layout, causal, log=True)
    with CommCounter() as fwd:
        out = attn(q, k, v)
    with CommCounter() as bwd:
        out.backward(dout)
    res = dict(out=out.detach(), dq=q.grad.clone(), dk=k.grad.clone(), dv=v.grad.clone(),
               work=dict(attn.work),
               bytes=(fwd.bytes("send") + fwd.bytes("all_to_all"), bwd.bytes("send") + bwd.bytes("all_to_all")),
               calls=(fwd.summary(), bwd.summary()))
    step = lambda: attn(q, k, v).backward(dout)  # noqa: E731
    res = _measure(res, step, q.device, memory, 0)
    if repeats:   # time_steps makes repeats + 1 calls (one warm-up)
        attn.work["wait_s"] = 0.0
        res = _measure(res, step, q.device, False, repeats, group)
        res["wait"] = attn.work["wait_s"] / (repeats + 1)
    return res


def run_cases(cases: list[dict]) -> list[dict]:
    """Rank function: attention_case for every case, on a cp group of the whole world."""
    group = Mesh(cp=dist.get_world_size()).group("cp")
    return [attention_case(group=group, **c) for c in cases]


def full_attention(B=2, S=32, H=4, Hkv=2, D=8, causal=True, dtype=torch.float64, seed=0, repeats=0, memory=False,
                   device=None, round_to=None):
    """The reference: the same seeded batch through full-sequence SDPA, in one process."""
    q, k, v, dout = _inputs(B, S, H, Hkv, D, dtype, seed, device, round_to)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=H != Hkv)  # noqa: E731
    run().backward(dout)
    res = dict(out=run().detach(), dq=q.grad.clone(), dk=k.grad.clone(), dv=v.grad.clone())
    return _measure(res, lambda: run().backward(dout), q.device, memory, repeats)


def memory_sweep(seq_lens, layouts=LAYOUTS, **shape) -> dict:
    """Rank function: this rank's peak ring-attention memory (forward + backward) per layout and S."""
    group = Mesh(cp=dist.get_world_size()).group("cp")
    return {layout: [attention_case(S=S, method="ring", layout=layout, dtype=torch.float32, group=group,
                                    memory=True, **shape)["peak_bytes"] for S in seq_lens]
            for layout in layouts}


# ---- demo --------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("batch", 1), ("seq", 512), ("heads", 8), ("kv-heads", 4), ("head-dim", 32),
                          ("repeats", 3), ("model-steps", 3)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--no-causal", action="store_true")
    args = ap.parse_args()
    device = init_distributed()
    cp, rank = dist.get_world_size(), dist.get_rank()
    check_layout(args.seq, cp, "zigzag")    # before any collective
    group = Mesh(cp=cp).group("cp")
    alone = [dist.new_group([r]) for r in range(cp)][rank]   # a cp=1 "ring": the same kernel, full S
    shape = dict(B=args.batch, S=args.seq, H=args.heads, Hkv=args.kv_heads, D=args.head_dim,
                 causal=not args.no_causal, dtype=torch.float32, repeats=args.repeats, memory=True, device=device)
    ref = full_attention(**shape)
    one = attention_case(**shape, layout="contiguous", group=alone)
    print0(f"cp={cp} ranks, B={args.batch} S={args.seq} heads={args.heads} kv_heads={args.kv_heads} "
           f"head_dim={args.head_dim} {'full' if args.no_causal else 'causal'} fp32, device {device}")
    print0(f"{'one rank, full S':24s}{'work (fwd GFLOP)':>18s}{'peak MiB':>10s}{'ms':>8s}")
    print0(f"{'  PyTorch SDPA':24s}{'':>18s}{ref['peak_bytes'] / 2**20:10.2f}{ref['time'] * 1e3:8.1f}")
    print0(f"{'  hand kernel (cp=1)':24s}{one['work']['flops'] / 1e9:18.3f}{one['peak_bytes'] / 2**20:10.2f}"
           f"{one['time'] * 1e3:8.1f}")
    print0(f"{'cp=' + str(cp) + ', per rank':24s}{'max err':>9s}{'work (fwd GFLOP)':>30s}{'peak MiB':>26s}"
           f"{'bytes/layer fwd+bwd (formula)':>32s}{'ms':>8s}")
    ok, c = True, args.seq // cp
    for method, layout in [("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "contiguous")]:
        if method == "ulysses" and args.heads % cp:
            print0(f"  (Ulysses skipped: {args.heads} heads are not divisible by cp={cp})")
            continue
        res = attention_case(**shape, method=method, layout=layout, group=group)
        err = max((res[n] - shard_sequence(ref[n], cp, rank, layout, dim=2)).abs().max().item()
                  for n in ("out", "dq", "dk", "dv"))
        every = [torch.empty(5, device=device) for _ in range(cp)]
        dist.all_gather(every, torch.tensor([err, res["work"]["flops"] / 1e9, res["peak_bytes"] / 2**20,
                                             res["time"], res.get("wait", 0.0)], device=device), group=group)
        err, work, peak, ms, wait = torch.stack(every).T.tolist()
        formula = sum(ring_bytes(args.batch, c, args.kv_heads, args.head_dim, cp, 4) if method == "ring" else
                      [ulysses_bytes(args.batch, c, args.heads, args.kv_heads, args.head_dim, cp, 4)] * 2)
        ok &= max(err) < 1e-4 and sum(res["bytes"]) == formula
        work = " ".join(f"{w:.3f}" for w in work) if method == "ring" else "equal: H/cp heads, full S"
        print0(f"  {method + ' ' + layout:22s}{max(err):9.1e}{work:>30s}{' '.join(f'{m:.2f}' for m in peak):>26s}"
               f"{sum(res['bytes']):>17,d} ({formula:,d}){max(ms) * 1e3:8.1f}")
        if method == "ring":   # forward only: time blocked in wait() for the next k, v block
            print0(f"{'':24s}forward waits for the next block, ms per rank: "
                   + " ".join(f"{w * 1e3:.1f}" for w in wait))
    ok &= train_demo(args.model_steps, group, device)
    print0("all checks", "ok" if ok else "FAILED")
    dist.destroy_process_group()
    return 0 if ok else 1


def train_demo(n_steps, group, device) -> bool:
    """The shared tiny model, each sequence spread over the cp ranks, against one process."""
    from data import get_batch, load_corpus
    from model import build_model
    tokens = load_corpus()
    batches = [get_batch(tokens, s, 2, 32, seed=0) for s in range(n_steps)]
    model = build_model("tiny", seed=0, device=device)
    opt, ref = torch.optim.AdamW(model.parameters(), lr=1e-3), []
    for x, y in batches:
        ref.append(model(x.to(device), y.to(device)))
        ref[-1].backward()
        opt.step()
        opt.zero_grad()
    ref, ok = [l.item() for l in ref], True
    print0(f"tiny model, {n_steps} steps, S=32, cp={dist.get_world_size(group)}: one process "
           + " ".join(f"{l:.5f}" for l in ref))
    for method, layout in [("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "zigzag")]:
        if method == "ulysses" and model.cfg.n_heads % dist.get_world_size(group):
            continue
        losses, _ = train_cp("tiny", batches, group, method, layout, device=device)
        diff = max(abs(a - b) for a, b in zip(losses, ref))
        ok &= diff < 1e-5
        print0(f"  {method + ' ' + layout:20s} " + " ".join(f"{l:.5f}" for l in losses) + f"  max |diff| {diff:.1e}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
