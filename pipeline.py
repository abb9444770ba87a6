"""Lesson 5 — pipeline parallel: stages, micro-batches and the schedule.

The idea
--------
Cut the model by depth into p stages, one per rank of the pp group: stage 0 holds the embedding
and the first layers, stage p-1 the last layers, the final norm, the head and the loss. The
local batch [B, S] is split into m micro-batches [B/m, S]; a stage works on one micro-batch while
its neighbours work on others. The order of its forwards (F), backwards (B) and, split off the
backward, weight-gradient passes (W) is the *schedule*. Below, first 1F1B written out as plain
control flow; then schedules as data (lists of actions built by pure functions) run by one runner.

Per micro-batch, t_f forward, t_b input-gradient backward, t_w weight-gradient backward on one
stage (1:1:1 by the usual count of matmuls: Qi et al. 2024). Idle time of each stage per step:
    GPipe        (p-1)(t_f+t_b+t_w)      holds m micro-batches             Huang et al. 2019, arXiv:1811.06965
    1F1B         (p-1)(t_f+t_b+t_w)      holds min(p-r, m)                 Narayanan et al. 2021, arXiv:2104.04473 §2.2
    interleaved  (p-1)(t_f+t_b+t_w)/v    holds min(2(p-r-1)+(v-1)p+1, vm) chunk-micro-batches (each 1/v of a
                 stage's): rank r runs v chunks, virtual stages r, r+p, ..; needs m % p == 0 (ibid. §2.2)
    ZB-H1        (p-1)(t_f+t_b) - (min(m,p)-1)·t_w   = (p-1)(t_f+t_b-t_w) for m >= p; holds min(p, m)
                 Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, arXiv:2401.10241 §2.1
The ideal step is m(t_f+t_b+t_w); 1F1B's bubble is (p-1)/m of it, interleaved's (p-1)/(v·m), and
ZB-H1's a third of 1F1B's at 1:1:1. 1F1B does not shrink GPipe's bubble: it shrinks the
activations held, so m can grow. It also runs with m < p (warm-up min(p-r-1, m)).

Communication, point to point between neighbours only: per step and stage boundary m activations
forward and m gradients back, each [B/m, S, H] — 2·B·S·H·b bytes each way pair (API bytes =
wire bytes: a send moves its tensor once). Interleaved crosses p·v-1 boundaries instead of p-1:
about v× the traffic. Memory: a rank holds L/p of the layers (their gradients and optimizer state)
and the activations of the micro-batches above. Each micro-batch loss is scaled by 1/m, so the
m backwards add up to the full-batch gradient; data-parallel replicas of a stage all-reduce it once.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from instruments import SavedActivations, Timeline
from mesh import all_reduce_flat
from model import MoE, Transformer, init_tensor, rope_cos_sin


# ---- the simplest version: 1F1B as plain control flow ----------------------------------------

def one_f_one_b_plain(stage, pg, x, y, m: int):
    """One 1F1B step of this rank's stage, written out; returns the mean loss on the last stage.
    Warm-up: w = min(p-r-1, m) forwards; steady: a forward, then a backward; cool-down: w backwards."""
    shape, dtype = (x.shape[0] // m, x.shape[1], stage.cfg.dim), next(stage.parameters()).dtype
    xs, ys = x.chunk(m), y.chunk(m) if stage.is_last else None
    inputs, outputs, losses = [], [], []

    def p2p(send=None, to=None, recv_from=None):
        # A send and a receive are posted TOGETHER, then both awaited: one after the other, rank r
        # sending F i+1 while rank r+1 sends back B i would each wait for the other forever.
        buf = None if recv_from is None else torch.empty(shape, dtype=dtype, device=x.device)
        ops = ([dist.P2POp(dist.isend, send, to)] if send is not None and to is not None else []) \
            + ([dist.P2POp(dist.irecv, buf, recv_from)] if buf is not None else [])
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return buf if buf is None else buf.requires_grad_(recv_from == pg.prev)   # an input: send its gradient back

    def forward(i, inp):               # inp: tokens [b, S] or an activation [b, S, H]
        out = stage(inp, ys[i]) if stage.is_last else stage(inp)
        inputs.append(inp)
        outputs.append(out / m if stage.is_last else out)   # 1/m: m micro-batch means add up to the batch mean
        losses.extend([out.detach()] if stage.is_last else [])
        return None if stage.is_last else out.detach()

    def backward(grad):                # the oldest micro-batch in flight
        inp, out = inputs.pop(0), outputs.pop(0)
        out.backward(grad)
        return None if stage.is_first else inp.grad

    w = min(pg.p - pg.r - 1, m)
    inp = xs[0] if stage.is_first else p2p(recv_from=pg.prev)
    for i in range(w):                                            # warm-up
        p2p(forward(i, inp), pg.next)
        if i + 1 < m:
            inp = xs[i + 1] if stage.is_first else p2p(recv_from=pg.prev)
    for i in range(w, m):                                         # steady: F i, then B i-w
        grad = p2p(forward(i, inp), pg.next, pg.next)             # send F i's output, get B i-w's gradient
        more = i + 1 < m
        inp = p2p(backward(grad), pg.prev, pg.prev if more else None)   # send B i-w's, get F i+1's input
        inp = xs[i + 1] if stage.is_first and more else inp
    for _ in range(w):                                            # cool-down
        p2p(backward(p2p(recv_from=pg.next)), pg.prev)
    return torch.stack(losses).mean() if stage.is_last else None


# ---- the model part one rank holds -----------------------------------------------------------------

def split_layers(n_layers: int, n: int) -> list[range]:
    """Layer indices of each of n stages, balanced; the first n_layers % n take one more (the last
    stage already carries the head and the loss, the first only an embedding lookup)."""
    base, extra = divmod(n_layers, n)
    sizes = [base + (s < extra) for s in range(n)]
    return [range(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(n)]


class Stage(nn.Module):
    """Rank r's part of the shared Transformer: its v chunks, the virtual stages r, r+p, .., r+(v-1)p of
    p·v (v = 1: stage r of p). Parameters keep the full model's names (layers.5.attn.wq.weight), so
    each is initialised as in the whole model; other ranks' layers are never allocated."""

    def __init__(self, cfg, r: int, p: int, seed: int = 0, device=None, dtype=torch.float32, v: int = 1):
        super().__init__()
        self.cfg, self.v, self.is_first, self.is_last = cfg, v, r == 0, r == p - 1
        self.chunks = [list(split_layers(cfg.n_layers, p * v)[c * p + r]) for c in range(v)]  # layer ids
        with torch.device("meta"):                                                          # shapes only
            full = Transformer(cfg, seed=None)
        self.tok_embeddings = full.tok_embeddings if self.is_first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i] for ids in self.chunks for i in ids})
        if self.is_last:
            self.norm, self.output, self.loss_fn = full.norm, full.output, full.loss_fn
        self.to_empty(device=device or "cpu")
        with torch.no_grad():
            for name, prm in self.named_parameters():
                prm.copy_(init_tensor(cfg, name, tuple(prm.shape), seed))
        self.to(dtype)
        self.positions = None  # absolute token positions [S] (a context-parallel shard); None: 0..S-1

    def forward(self, x, targets=None, positions=None, chunk: int = 0):
        """tokens [b, S] (chunk 0 of rank 0) or activations [b, S, H] -> [b, S, H]; the last chunk of
        the last rank returns logits [b, S, V], or the mean loss if targets are given."""
        h = self.tok_embeddings(x) if self.is_first and chunk == 0 else x
        pos = positions if positions is not None else self.positions
        pos = pos if pos is not None else torch.arange(h.shape[1], device=h.device)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        for i in self.chunks[chunk]:
            h = self.layers[str(i)](h, cos, sin)
        if not (self.is_last and chunk == self.v - 1):
            return h
        logits = self.output(self.norm(h))
        return logits if targets is None else self.loss_fn(logits, targets)

    def aux_loss(self, chunk: int = 0):
        """The MoE auxiliary loss of this chunk's last forward (as model.Transformer.aux_loss), or None."""
        aux = [self.layers[str(i)].mlp.aux_loss for i in self.chunks[chunk] if isinstance(self.layers[str(i)].mlp, MoE)]
        return sum(aux) if aux else None


# ---- schedules as data -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Action:
    op: str         # F, B, W (compute) or SEND_F, RECV_F, SEND_B, RECV_B (to/from a neighbour)
    mb: int         # micro-batch
    chunk: int = 0  # which of the rank's v chunks

    def __repr__(self):
        return f"{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


COMPUTE = ("F", "B", "W")


def _transfers(op, i, c, r, p, v):
    """(receives before, sends after) compute `op` of micro-batch i on chunk c of rank r."""
    s, n = c * p + r, p * v   # the virtual stage, of n
    recv, send = {"F": (s > 0, s < n - 1), "B": (s < n - 1, s > 0), "W": (False, False)}[op]
    return [Action("RECV_" + op, i, c)] * recv, [Action("SEND_" + op, i, c)] * send


def _by_ticks(ticks, r, p, v=1):
    """Computes grouped in ticks; between two ticks ONE batch of transfers: the sends of the tick
    before and the receives of the tick after (Megatron's send_forward_recv_backward and kin)."""
    out, sends = [], []
    for tick in ticks:
        out += sends + [a for op, i, c in tick for a in _transfers(op, i, c, r, p, v)[0]] + [Action(*a) for a in tick]
        sends = [a for op, i, c in tick for a in _transfers(op, i, c, r, p, v)[1]]
    return out + sends


def _one_chunk(v, name):
    if v != 1:
        raise ValueError(f"{name} runs one chunk per rank: use v = 1 (or the interleaved schedule)")


def gpipe(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """All forwards, then all backwards (ticks of one compute: receive just before, send just after)."""
    _one_chunk(v, "gpipe")
    return [_by_ticks([[("F", i, 0)] for i in range(m)] + [[("B", i, 0)] for i in range(m)], r, p) for r in range(p)]


def one_f_one_b(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Warm-up min(p-r-1, m) forwards, then F and B in turn, then the last backwards; any m >= 1."""
    _one_chunk(v, "1f1b")
    def order(w):
        return [("F", i, 0) for i in range(w)] + [a for i in range(w, m) for a in (("F", i, 0), ("B", i - w, 0))] \
            + [("B", i, 0) for i in range(m - w, m)]
    return [_by_ticks([[a] for a in order(min(p - r - 1, m))], r, p) for r in range(p)]


def interleaved(p: int, m: int, v: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B: micro-batches pass a rank's chunks in groups of p (so m % p == 0), depth first;
    warm-up 2(p-r-1)+(v-1)p chunk-forwards; one batch of transfers per (F, B) tick — with each transfer
    next to its compute, the last rank feeding the first deadlocks (see the tests)."""
    if m % p:
        raise ValueError(f"interleaved needs m a multiple of p, got m={m}, p={p}")
    def f(k): return ("F", k // (p * v) * p + k % p, k // p % v)
    def b(k): return ("B", k // (p * v) * p + k % p, v - 1 - k // p % v)
    n, sched = m * v, []
    for r in range(p):
        w = min(2 * (p - r - 1) + (v - 1) * p, n)
        sched.append(_by_ticks([[f(k)] for k in range(w)] + [[f(k), b(k - w)] for k in range(w, n)]
                               + [[b(k)] for k in range(n - w, n)], r, p, v))
    return sched


def zero_bubble(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """ZB-H1: 1F1B with each backward split into B (input gradient, on the critical path) and W (weight
    gradient). Rank r defers its first r W's (every rank then holds min(p, m)), so the B's travel back
    sooner; the deferred W's fill the tail. Transfers go where the ideal timeline has them."""
    _one_chunk(v, "zb")
    orders = []
    for r in range(p):
        w = min(p - r - 1, m)
        order = [Action("F", i) for i in range(w)]
        for i in range(m):
            order += [Action("F", i + w)] * (i + w < m) + [Action("B", i)] + [Action("W", i - r)] * (i >= r)
        orders.append(order + [Action("W", i) for i in range(max(m - r, 0), m)])
    return _at_ideal_times(orders, p)


def _at_ideal_times(orders, p, v=1):
    """Transfers where the ideal timeline (unit times, free transfers) has them: a send right after the
    compute that makes its data; its receive after the receiver's last compute ending by then. A
    rendezvous transfer holds both sides, so both must reach it at that same moment."""
    ideal = simulate(orders)["spans"]
    made = {(a.op, a.mb, a.chunk * p + r): end for r, spans in enumerate(ideal) for a, _, end in spans}
    sched = []
    for r, spans in enumerate(ideal):
        posts = [[] for _ in range(len(spans) + 1)]   # posts[k]: (time, transfer) posted just before compute k
        for k, (a, _, end) in enumerate(spans):
            recv, send = _transfers(a.op, a.mb, a.chunk, r, p, v)
            posts[k + 1] += [(end, x) for x in send]
            for x in recv:   # its data is made on the neighbouring virtual stage at time t
                t = made[(a.op, a.mb, a.chunk * p + r + (1 if a.op == "B" else -1))]
                posts[sum(e <= t for _, _, e in spans[:k])].append((t, x))
        acts = []
        for k, post in enumerate(posts):
            acts += [x for _, x in sorted(post, key=lambda q: (q[0], repr(q[1])))] + [a for a, _, _ in spans[k:k + 1]]
        sched.append(acts)
    return sched


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb": zero_bubble}


def validate(p: int, m: int, n_layers: int, batch: int, schedule: str = "1f1b", v: int = 1) -> None:
    """Pure arithmetic every rank does alike: a bad setting fails everywhere, before the first send."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {sorted(SCHEDULES)}")
    if m < 1 or batch % m:
        raise ValueError(f"batch {batch} is not divisible into {m} micro-batches: "
                         f"choose --microbatches among {[d for d in range(1, batch + 1) if batch % d == 0]}")
    if schedule == "interleaved" and (v < 2 or p < 2):
        raise ValueError(f"interleaved needs >= 2 ranks and >= 2 virtual stages per rank, got p={p}, v={v}: "
                         f"use --virtual-stages 2 or more on >= 2 ranks (one chunk per rank is 1f1b)")
    if schedule == "interleaved" and m % p:
        near = " or ".join(str(k) for k in (m // p * p, m // p * p + p) if k)
        raise ValueError(f"interleaved needs the micro-batches to be a multiple of p={p}, got m={m} (they pass a "
                         f"rank's chunks in groups of p): use --microbatches {near}")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"--virtual-stages {v} needs --schedule interleaved ({schedule} runs one chunk per rank)")
    if n_layers < p * v:
        raise ValueError(f"{n_layers} layers cannot fill {p * v} stages (p={p} x v={v}, each needs >= 1 layer): "
                         f"use a model with >= {p * v} layers, or fewer stages")


# ---- the runner: any schedule, one step ----------------------------------------------------------

@dataclass
class PipeGroup:
    """Where this rank sits: index r of the p global ranks `ranks`, in pipeline order."""
    r: int
    p: int
    ranks: list

    @classmethod
    def from_ranks(cls, ranks: list[int]) -> "PipeGroup":
        return cls(list(ranks).index(dist.get_rank()), len(ranks), list(ranks))

    def peer(self, d: int) -> int:   # wraps: an interleaved last rank feeds the first rank's next chunk
        return self.ranks[(self.r + d) % self.p]

    prev = property(lambda self: self.peer(-1) if self.r > 0 else None)
    next = property(lambda self: self.peer(+1) if self.r < self.p - 1 else None)


class _InputGradOnly(torch.autograd.Function):
    """y = x W^T + b whose backward returns dL/dx only (B) and leaves (x, dL/dy) for W. Weight and
    bias come in a tuple, out of autograd's sight: B has no edge to them, so no hook of theirs fires."""

    @staticmethod
    def forward(ctx, x, params, deferred):
        ctx.save_for_backward(x)
        ctx.params, ctx.deferred = params, deferred
        return F.linear(x, *params)

    @staticmethod
    def backward(ctx, gy):
        ctx.deferred.append((ctx.saved_tensors[0], gy, *ctx.params))
        return gy @ ctx.params[0], None, None


class DeferWeightGrads(TorchFunctionMode):
    """Inside it, every F.linear of a trainable weight on a differentiable input (nn.Linear, tensor_parallel's
    Column/RowParallelLinear) computes only dL/dx in backward; weight_grads(deferred) does the rest."""

    def __init__(self, deferred: list):
        super().__init__()
        self.deferred = deferred

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear or not (torch.is_grad_enabled() and args[0].requires_grad and args[1].requires_grad):
            return func(*args, **kwargs)
        x, w, b = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
        dev = x.device.type
        if torch.is_autocast_enabled(dev):   # cast as autocast would, outside the Function
            x, w, b = (t if t is None else t.to(torch.get_autocast_dtype(dev)) for t in (x, w, b))
        with torch.autocast(dev, enabled=False):
            return _InputGradOnly.apply(x, (w, b), self.deferred)


def weight_grads(deferred: list) -> None:
    """W: dL/dW = dL/dy^T x (and dL/db = sum of dL/dy) of each deferred linear — plus any (parameter,
    gradient) B already had — handed to autograd at once, so .grad and post-accumulate-grad hooks
    (ZeRO, DDP) see one ordinary backward per micro-batch."""
    params, grads = [], []
    for item in deferred:
        if len(item) == 2:
            params.append(item[0]), grads.append(item[1])
            continue
        x, gy, w, b = item
        gy2 = gy.reshape(-1, gy.shape[-1])
        params.append(w), grads.append(gy2.T @ x.reshape(-1, x.shape[-1]))   # [out, in]
        if b is not None:
            params.append(b), grads.append(gy2.sum(0))
    deferred.clear()
    if params:
        torch.autograd.backward(params, grads)


def comm_batches(actions: list[Action]) -> list[list[Action]]:
    """Each compute alone, each run of consecutive transfers together (one batch_isend_irecv)."""
    groups = []
    for a in actions:
        if a.op not in COMPUTE and groups and groups[-1][0].op not in COMPUTE:
            groups[-1].append(a)
        else:
            groups.append([a])
    return groups


def pipeline_step(stage: Stage, actions: list[Action], pg: PipeGroup, x, y, m: int, dp_group=None, *,
                  act_shape=None, act_dtype=None, trace=lambda group: nullcontext()) -> dict:
    """One forward+backward of the local batch x, y [B, S] (y: the last rank's targets) through this
    rank's actions; leaves the full-batch gradients in .grad (no optimizer step, no zero_grad).
    act_shape: one micro-batch's tensor at a stage boundary (default [B/m, S, H]; sequence parallel
    sends [B/m, S/tp, H]). trace(group): a context manager entered around each group of actions (a
    compute alone, consecutive transfers together): the place to measure from, outside.
    Returns dict(loss: the mean loss on the last rank, else None; aux: the MoE aux loss of this rank's
    layers, averaged over micro-batches — add it to the reported loss — or None)."""
    shape = act_shape or (x.shape[0] // m, x.shape[1], stage.cfg.dim)
    dtype = act_dtype or next(stage.parameters()).dtype
    xs, ys = x.chunk(m), (y.chunk(m) if stage.is_last else None)
    split = any(a.op == "W" for a in actions)
    inputs, outputs, grads, deferred, losses, aux = {}, {}, {}, {}, [], []

    def forward(a, key, first, last):
        out = stage(xs[a.mb] if first else inputs[key], ys[a.mb] if last else None, chunk=a.chunk)
        extra = stage.aux_loss(a.chunk)   # MoE layers: their aux loss is part of this micro-batch's loss
        outputs[key] = [out / m if last else out] + ([extra / m] if extra is not None else [])
        losses.extend([out.detach()] if last else [])
        aux.extend([extra.detach()] if extra is not None else [])

    def backward(key, last):   # (a sent activation's values are freed, see transfer: its graph is enough)
        outs = outputs.pop(key)
        grad_outs = [None if last else grads.pop(key)] + [None] * (len(outs) - 1)
        if not split:
            return torch.autograd.backward(outs, grad_outs)
        # B of a split backward: dL/d(input) now; every parameter's gradient waits for W (the linears'
        # are not even computed yet; norms', the embedding's are), so hooks see one pass per micro-batch
        params, inp = [q for q in stage.parameters() if q.requires_grad], inputs.get(key)
        got = torch.autograd.grad(outs, params + ([inp] if inp is not None else []), grad_outs, allow_unused=True)
        deferred[key] += [(q, g) for q, g in zip(params, got) if g is not None]
        if inp is not None:
            inp.grad = got[-1]

    def transfer(group):       # consecutive transfers: ONE batch_isend_irecv (NCCL runs it as a group)
        ops, sent = [], []
        for t in group:
            k, peer = (t.mb, t.chunk), pg.peer(+1 if t.op in ("SEND_F", "RECV_B") else -1)
            if t.op == "SEND_F":   # (contiguous: a sequence-parallel [b, S/t, H] is a transposed view)
                sent.append(outputs[k][0])
                ops.append(dist.P2POp(dist.isend, sent[-1].contiguous(), peer))
            elif t.op == "SEND_B":
                ops.append(dist.P2POp(dist.isend, inputs.pop(k).grad.contiguous(), peer))
            else:
                buf = (inputs if t.op == "RECV_F" else grads)[k] = torch.empty(shape, dtype=dtype, device=x.device)
                ops.append(dist.P2POp(dist.irecv, buf, peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for t in sent:   # sent, not needed again: the stage ends in a residual add, which saves no
            t.untyped_storage().resize_(0)   # output, so its backward needs only the graph
        for t in group:
            if t.op == "RECV_F":
                inputs[(t.mb, t.chunk)].requires_grad_()   # so its gradient can be sent back

    for group in comm_batches(actions):
        a, key = group[0], (group[0].mb, group[0].chunk)
        first, last = stage.is_first and a.chunk == 0, stage.is_last and a.chunk == stage.v - 1
        split_here = DeferWeightGrads(deferred.setdefault(key, [])) if split and a.op in ("F", "B") else nullcontext()
        with trace(group), split_here:
            if a.op == "F":
                forward(a, key, first, last)
            elif a.op == "B":
                backward(key, last)
            elif a.op == "W":
                weight_grads(deferred.pop(key))
            else:
                transfer(group)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:   # replicas of this stage: one all-reduce
        all_reduce_flat([q.grad for q in stage.parameters() if q.grad is not None], dp_group,
                        divide_by=dist.get_world_size(dp_group))
    return dict(loss=torch.stack(losses).sum() / m if losses else None, aux=torch.stack(aux).sum() / m if aux else None)


# ---- checking and playing a schedule without running it ------------------------------------------

def _message(a: Action, r: int, p: int):
    """A transfer as (role, message): a message is (kind, micro-batch, the virtual stage that made it)."""
    s = a.chunk * p + r
    return a.op[:4], (a.op[-1], a.mb, {"SEND_F": s, "SEND_B": s, "RECV_F": s - 1, "RECV_B": s + 1}[a.op])


def check_schedule(sched: list[list[Action]]) -> None:
    """Raise ValueError unless every chunk of every rank runs F, B (and W if the schedule splits) of each
    micro-batch once, with exactly the transfers it needs, each in order with what depends on it, and
    each pair of ranks sends and receives the same messages in the same order."""
    p, v = len(sched), 1 + max(a.chunk for acts in sched for a in acts)
    m, split, pairs = sum(a.op == "F" for a in sched[0]) // v, any(a.op == "W" for acts in sched for a in acts), {}
    for r, acts in enumerate(sched):
        pos = {a: k for k, a in enumerate(acts)}
        need = {x for i in range(m) for c in range(v) for op in "FBW"[:2 + split]
                for x in [Action(op, i, c)] + sum(_transfers(op, i, c, r, p, v), [])}
        if len(pos) != len(acts) or set(pos) != need:
            raise ValueError(f"rank {r}: missing {sorted(map(repr, need - set(pos)))}, unexpected or repeated "
                             f"{sorted(map(repr, set(pos) - need)) or [a for a in acts if acts.count(a) > 1]}")
        for a, b in [("RECV_F", "F"), ("F", "SEND_F"), ("F", "B"), ("RECV_B", "B"), ("B", "SEND_B"), ("B", "W")]:
            for i, c in ((i, c) for i in range(m) for c in range(v)):
                if pos.get(Action(a, i, c), -1) > pos.get(Action(b, i, c), len(acts)):
                    raise ValueError(f"rank {r}: {Action(b, i, c)} before {Action(a, i, c)}: out of order")
        for a in (a for a in acts if a.op not in COMPUTE):
            role, msg = _message(a, r, p)
            peer = (r + (1 if a.op in ("SEND_F", "RECV_B") else -1)) % p
            pairs.setdefault(((r, peer) if role == "SEND" else (peer, r), role), []).append(msg)
    for (pair, role), msgs in pairs.items():
        if msgs != pairs.get((pair, "RECV" if role == "SEND" else "SEND")):
            raise ValueError(f"ranks {pair}: the messages are sent and received in a different order")


def simulate(sched: list[list[Action]], t_f=1, t_b=1, t_w=1) -> dict:
    """Play a schedule: per micro-batch and stage t_f forward, t_b input gradient, t_w weight gradient
    (an unsplit B: t_b + t_w), a chunk 1/v of that. Transfers are free but *rendezvous*: a batch ends
    once every partner has reached the batch holding its match — the strictest backend (gloo's send
    waits for its receive), so a schedule that finishes here cannot deadlock; one that does not raises.
    Computes alone are played with free, instant transfers (the ideal timeline).
    Returns spans [(action, start, end)] per rank, total, idle and bubble (idle/total) per rank, and
    peak_in_flight (micro-batches between F and the pass that frees them: W if split, else B)."""
    p, v = len(sched), 1 + max(a.chunk for acts in sched for a in acts)
    split, free = any(a.op == "W" for acts in sched for a in acts), all(a.op in COMPUTE for acts in sched for a in acts)
    cost, n = {"F": t_f / v, "B": (t_b if split else t_b + t_w) / v, "W": t_w / v}, p * v
    groups = [comm_batches(acts) for acts in sched]
    idx, clock, posted, ready, held, peak = [0] * p, [0] * p, {}, {}, [0] * p, [0] * p
    spans, progress = [[] for _ in range(p)], True
    while progress:
        progress = False
        for r in range(p):
            while idx[r] < len(groups[r]):
                g = groups[r][idx[r]]
                if g[0].op in COMPUTE:
                    a = g[0]
                    s = a.chunk * p + r
                    dep = {"F": ("F", a.mb, s - 1) if s > 0 else None, "W": None,
                           "B": ("B", a.mb, s + 1) if s < n - 1 else None}[a.op] if free else None
                    if dep is not None and dep not in ready:
                        break   # its input is made on a rank that has not got there yet
                    start = max(clock[r], ready.get(dep, 0))
                    clock[r] = ready[(a.op, a.mb, s)] = start + cost[a.op]
                    held[r] += {"F": 1, "B": -(not split), "W": -1}[a.op]
                    peak[r] = max(peak[r], held[r])
                    spans[r].append((a, start, clock[r]))
                else:
                    msgs = [_message(a, r, p) for a in g]
                    for q in msgs:
                        posted.setdefault(q, clock[r])
                    partners = [("RECV" if role == "SEND" else "SEND", msg) for role, msg in msgs]
                    if not all(q in posted for q in partners):
                        break   # blocked until the peers get there
                    clock[r] = max(posted[q] for q in msgs + partners)
                    spans[r] += [(a, posted[q], clock[r]) for a, q in zip(g, msgs)]
                idx[r] += 1
                progress = True
    if any(idx[r] < len(groups[r]) for r in range(p)):
        stuck = {r: groups[r][idx[r]] for r in range(p) if idx[r] < len(groups[r])}
        raise RuntimeError(f"schedule deadlocks: ranks wait at {stuck}")
    total = max(clock)
    idle = [total - sum(e - s for a, s, e in sp if a.op in COMPUTE) for sp in spans]
    return dict(spans=spans, total=total, idle=idle, bubble=[i / total for i in idle], peak_in_flight=peak)


def idle_formula(name: str, p: int, m: int, v: int = 1, t_f=1, t_b=1, t_w=1):
    """Each rank's idle time per step, from the papers (see the module docstring)."""
    if name == "zb":
        return (p - 1) * (t_f + t_b) - (min(m, p) - 1) * t_w
    return (p - 1) * (t_f + t_b + t_w) / (v if name == "interleaved" else 1)


def held_formula(name: str, p: int, m: int, r: int, v: int = 1) -> int:
    """Micro-batches (interleaved: chunk-micro-batches) rank r holds at its peak."""
    return {"gpipe": m, "1f1b": min(p - r, m), "zb": min(p, m),
            "interleaved": min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)}[name]


# ---- measuring from outside: the trace hook, and training with it --------------------------------

class StepTrace:
    """A `trace` for pipeline_step: one Timeline span per group of actions, and (held=True) the micro-batches
    whose saved activations are alive after each group (instruments.SavedActivations)."""

    def __init__(self, stage, held: bool = True):
        self.timeline, self.saved = Timeline(), SavedActivations(stage.parameters()) if held else None

    @contextmanager
    def __call__(self, group):
        a = group[0]
        track = self.saved.track((a.mb, a.chunk)) if self.saved and a.op == "F" else nullcontext()
        with self.timeline.span(a.op if a.op in COMPUTE else "comm", ops=[repr(g) for g in group]), track:
            yield
        if self.saved:
            self.saved.sample()


def train(cfg, schedule: str, m: int, batches, pp_ranks, v: int = 1, dp_group=None, dp_rank: int = 0,
          dp_size: int = 1, lr: float = 1e-3, seed: int = 0, dtype=torch.float32, device="cpu") -> dict:
    """Train this rank's stage on global batches [(x, y)], one AdamW step each (lr=0: none). Returns the
    losses (last rank), the first step's gradients by name, the last step's timeline and peak held."""
    validate(len(pp_ranks), m, cfg.n_layers, batches[0][0].shape[0] // dp_size, schedule, v)  # before any send
    pg = PipeGroup.from_ranks(pp_ranks)
    stage, actions = Stage(cfg, pg.r, pg.p, seed, device, dtype, v), SCHEDULES[schedule](pg.p, m, v)[pg.r]
    opt = torch.optim.AdamW(stage.parameters(), lr=lr) if lr else None
    out = dict(losses=[], grads=None, stage=stage, actions=actions, pg=pg)
    for x, y in batches:
        b = x.shape[0] // dp_size
        x, y = x[dp_rank * b:(dp_rank + 1) * b].to(device), y[dp_rank * b:(dp_rank + 1) * b].to(device)
        dist.barrier()   # every rank starts the step together: the timelines share an origin
        trace = StepTrace(stage)
        res = pipeline_step(stage, actions, pg, x, y, m, dp_group, trace=trace)
        out["grads"] = out["grads"] or {n: q.grad.detach().clone() for n, q in stage.named_parameters()}
        if opt:
            opt.step()
        stage.zero_grad(set_to_none=True)
        out["losses"].append(None if res["loss"] is None else res["loss"].item())
        out.update(spans=trace.timeline.spans, peak_held=trace.saved.peak_keys, peak_bytes=trace.saved.peak_bytes)
    return out


def timeline_ranks(configs, model: str = "small", n_layers: int = 8, batch: int = 8, seq: int = 32) -> dict:
    """For launch.run_ranks (the notebook): per (schedule, m, v), two steps with lr=0; the second's spans."""
    from data import get_batch, load_corpus
    from model import get_config
    batches = [get_batch(load_corpus(), s, batch, seq) for s in range(2)]
    return {c: {k: v for k, v in train(get_config(model, n_layers=n_layers), c[0], c[1], batches,
                                       list(range(dist.get_world_size())), c[2], lr=0).items()
                if k in ("spans", "peak_held", "peak_bytes")} for c in configs}


# ---- demo (PyTorch's own pipelining appears only below the __main__ line, as the reference) ----------

def _demo(argv=None, reference=None) -> int:
    import argparse
    import os

    from data import get_batch, load_corpus
    from demo import all_agree, finish, single_process
    from instruments import ascii_timeline, idle_share
    from mesh import Mesh, init_distributed, print0
    from model import build_model, get_config
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=None, help="chunks per rank (default: 2 interleaved, else 1)")
    ap.add_argument("--model", default="small")
    ap.add_argument("--layers", type=int, default=None, help="n_layers (default: 2 per chunk)")
    for name, default in [("batch", 8), ("seq", 32), ("steps", 2), ("dp", 1)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--compare", action="store_true", help="also run torch.distributed.pipelining's schedule")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    v = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)
    if world % args.dp or args.batch % args.dp:
        raise ValueError(f"--dp {args.dp} must divide the world size {world} and --batch {args.batch}")
    p, m, name = world // args.dp, args.microbatches, args.schedule
    cfg = get_config(args.model, n_layers=args.layers or 2 * p * v)
    validate(p, m, cfg.n_layers, args.batch // args.dp, name, v)   # before any collective
    device = init_distributed()
    mesh = Mesh(pp=p, dp_replicate=args.dp)
    batches = [get_batch(load_corpus(), s, args.batch, args.seq) for s in range(args.steps)]
    out = train(cfg, name, m, batches, mesh.ranks("pp"), v, mesh.group("dp"), mesh.rank("dp"), args.dp, device=device)
    every = [None] * dist.get_world_size()   # rank 0 prints what every rank of replica 0 measured
    dist.all_gather_object(every, (mesh.coords["pp"], mesh.rank("dp"), out["spans"], out["peak_held"],
                                   out["peak_bytes"], out["losses"]))
    rows = sorted((e for e in every if e[1] == 0), key=lambda e: e[0])
    ok = True
    if dist.get_rank() == 0:
        ref = single_process(build_model(cfg, seed=0), batches)["losses"]   # the same model in one process
        ok = max(abs(a - b) for a, b in zip(rows[-1][5], ref)) < 1e-4
        measured, total = idle_share([e[2] for e in rows])
        idle, sim = idle_formula(name, p, m, v), simulate(SCHEDULES[name](p, m, v))
        print(f"{name}: p={p} ranks x v={v} chunks x dp={args.dp}, m={m} micro-batches of {args.batch // args.dp // m};"
              f" {cfg.n_layers} layers split {[len(s) for s in split_layers(cfg.n_layers, p * v)]}\n"
              f"  losses {[round(x, 6) for x in rows[-1][5]]}, one process {[round(x, 6) for x in ref]}\n"
              f"last step {total * 1e3:.0f} ms (F forward, B backward, W weight gradient, . idle):\n"
              + ascii_timeline([e[2] for e in rows]) + "\n"
              f"  bubble, idle share of the step: formula {idle / (3 * m + idle):.3f}, "
              f"simulated {sim['bubble'][0]:.3f}, measured per rank " + " ".join(f"{b:.3f}" for b in measured) + "\n"
              "  micro-batches held at the peak, formula/measured from autograd's saved tensors: "
              + "  ".join(f"{held_formula(name, p, m, r, v)}/{e[3]}" for r, e in enumerate(rows))
              + "   activation MB: " + " ".join(f"{e[4] / 2**20:.1f}" for e in rows), flush=True)
    ok = all_agree(ok)
    if args.compare and reference is not None and args.dp == 1:
        ok &= reference(out, cfg, name, m, batches[0], device, mesh.group("pp"))
    print0("loss matches the single-process model:", "ok" if ok else "FAILED")
    return finish(ok)


if __name__ == "__main__":
    import copy

    import torch.distributed.pipelining as pl

    from demo import all_agree, main
    from instruments import time_steps
    from mesh import print0
    from model import CrossEntropy
    NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
             "zb": "ScheduleInterleavedZeroBubble"}   # PyTorch's zero-bubble for one stage per rank: ZB-H1's order

    def torch_pipelining(out, cfg, name, m, batch, device, group) -> bool:
        """The same split run by torch.distributed.pipelining's schedule of the same name: gradients and
        step time side by side. Shapes are given up front, as ours are; every rank passes the loss."""
        if not hasattr(pl, NAMES[name]):
            print0(f"  torch {torch.__version__} has no {NAMES[name]}")
            return True
        (x, y), pg, ours = (t.to(device) for t in batch), out["pg"], copy.deepcopy(out["stage"])
        p, v, b, n = pg.p, ours.v, x.shape[0] // m, pg.p * ours.v
        chunks = [Stage(cfg, c * p + pg.r, n, 0, device, next(ours.parameters()).dtype) for c in range(v)]
        for ch in chunks:   # our trained weights: a chunk's names are a subset of the stage's
            ch.load_state_dict({k: t for k, t in ours.state_dict().items() if k in ch.state_dict()})
        act = torch.empty(b, x.shape[1], cfg.dim, device=device, requires_grad=True)
        stages = [pl.PipelineStage(ch, c * p + pg.r, n, device, group=group,
                                   input_args=(x[:b],) if c * p + pg.r == 0 else (act,),
                                   output_args=(torch.empty(b, x.shape[1], cfg.vocab_size, device=device),)
                                   if c * p + pg.r == n - 1 else (act,)) for c, ch in enumerate(chunks)]
        multi = NAMES[name] in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
        sched = getattr(pl, NAMES[name])(stages if multi else stages[0], m, loss_fn=CrossEntropy())
        steps = dict(ours=lambda: pipeline_step(ours, out["actions"], pg, x, y, m),
                     theirs=lambda: sched.step(*((x,) if pg.r == 0 else ()), target=y if pg.r == p - 1 else None))
        for f in steps.values():   # one step each: the gradients must agree
            f()
        theirs = {k: q for ch in chunks for k, q in ch.named_parameters()}
        diff = torch.tensor([max((q.grad - theirs[k].grad).abs().max().item() for k, q in ours.named_parameters())])
        times = {k: [] for k in steps}
        for _ in range(3):   # alternate, so drift in machine load hits both alike
            for k, f in steps.items():
                for mod in [ours] + chunks:
                    mod.zero_grad(set_to_none=True)
                dist.barrier()
                times[k].append(time_steps(f, 2, device=device))
        t = torch.tensor([min(times["ours"]), min(times["theirs"])])
        for tensor in (diff, t):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        print0(f"  torch.distributed.pipelining {NAMES[name]}: gradients max |diff| {diff.item():.1e}; step time "
               f"ours {t[0] * 1e3:.1f} ms, theirs {t[1] * 1e3:.1f} ms: ours/theirs {t[0] / t[1]:.2f}")
        return all_agree(diff.item() < 1e-6)

    main(lambda argv: _demo(argv, reference=torch_pipelining))
