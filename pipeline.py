"""Lesson 5 — pipeline parallel: stages, micro-batches, schedules and the runner.

Cut the model by depth into p stages, one per rank of the pp group: stage 0 holds the embedding and
the first layers, stage p-1 the last layers, the final norm, the head and the loss. The local batch
[B, S] is split into m micro-batches [B/m, S]; a stage works on one micro-batch while its neighbours
work on others. The order of its forwards (F), backwards (B) and, for zero bubble, weight-gradient
passes (W) is the *schedule*. In the order of this file:
  1. The core: 1F1B written out as plain control flow — warm-up forwards, then F and B in turn, then
     cool-down — on any stage module (PipeGroup: where this rank sits).
  2. Stage: the layers one rank holds (v chunks of them when interleaved), running the model's own code.
  3. Schedules as data: `SCHEDULES[name](p, m, v)` gives each rank a list of Actions (F3, RECV_B2,
     SEND_F5.1 for chunk 1), built by pure functions — GPipe, 1F1B, interleaved 1F1B, ZB-H1.
  4. The checker: `check_schedule` proves every list complete and consistent with its neighbours';
     `simulate` plays them in time under the rendezvous rule and finds any deadlock — no process needed.
  5. The runner, `pipeline_step`: one step of any schedule on the ranks.
  6. Zero bubble's split of the backward, for real in autograd: B, the input gradient dL/dx the stage
     before waits for, and W, the weight gradient dL/dW = dL/dy^T x nobody waits for (Qi et al. 2024).
  7. For the capstone: a head tied to the embedding, held by the first and the last stage, its gradient summed.

Per micro-batch, t_f forward, t_b input-gradient backward, t_w weight-gradient backward on one stage
(1:1:1 by the usual count of matmuls: Qi et al. 2024). Idle time of each stage per step:
    GPipe        (p-1)(t_f+t_b+t_w)      holds m micro-batches             Huang et al. 2019, arXiv:1811.06965
    1F1B         (p-1)(t_f+t_b+t_w)      holds min(p-r, m)                 Narayanan et al. 2021, arXiv:2104.04473 §2.2
    interleaved  (p-1)(t_f+t_b+t_w)/v    holds min(2(p-r-1)+(v-1)p+1, vm) chunk-micro-batches (each 1/v of a
                 stage's): rank r runs v chunks, virtual stages r, r+p, ..; needs m % p == 0 (ibid. §2.2)
    ZB-H1        (p-1)(t_f+t_b) - (min(m,p)-1)·t_w   = (p-1)(t_f+t_b-t_w) for m >= p; holds min(p, m)
                 Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, arXiv:2401.10241 §2.1
The ideal step is m(t_f+t_b+t_w); 1F1B's bubble is (p-1)/m of it, interleaved's (p-1)/(v·m), and
ZB-H1's a third of 1F1B's at 1:1:1. 1F1B does not shrink GPipe's bubble: it shrinks the activations
held, so m can grow. It also runs with m < p (warm-up min(p-r-1, m)).

Communication, point to point between neighbours only: per step and stage boundary m activations
forward and m gradients back, each [B/m, S, H] — 2·B·S·H·b bytes per boundary (API bytes = wire
bytes: a send moves its tensor once); interleaved crosses p·v-1 boundaries instead of p-1. A transfer
is a rendezvous (gloo's send waits for its receive; NCCL groups make it so), so both sides must reach
it together: transfers between two computes go in ONE batch (Megatron's send_forward_recv_backward).
Memory: a rank holds L/p of the layers (their gradients and optimizer state) and the activations of
the micro-batches in flight. Each micro-batch loss is scaled by 1/m, so the m backwards add up to the
full-batch gradient; data-parallel replicas of a stage then average it (ddp.average_gradients, or
ZeRO's reduction). With ZeRO-2/3 (fsdp.shard_model), zero bubble's W delivers weight gradients after
a unit's backward has reached its inputs, so the step must run inside opt.accumulating().
"""
from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lab.model import MoE, Transformer, init_tensor


# ---- 1. the core: 1F1B as plain control flow ---------------------------------------------------------

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


def one_f_one_b_plain(stage, pipe, x, y, m: int):
    """One 1F1B step of this rank's stage, written out; returns the mean loss on the last stage and leaves the
    batch's gradients in .grad. Warm-up: w = min(p-r-1, m) forwards; steady: a forward, then a backward;
    cool-down: w backwards. `stage`: a module with is_first, is_last and cfg.dim (a Stage, section 2) that maps
    tokens [b, S] (first) or activations [b, S, H] to activations [b, S, H], or the mean loss (last, given y)."""
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
        return buf if buf is None else buf.requires_grad_(recv_from == pipe.prev)   # an input: send its gradient back

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

    w = min(pipe.p - pipe.r - 1, m)
    inp = xs[0] if stage.is_first else p2p(recv_from=pipe.prev)
    for i in range(w):                                            # warm-up
        p2p(forward(i, inp), pipe.next)
        if i + 1 < m:
            inp = xs[i + 1] if stage.is_first else p2p(recv_from=pipe.prev)
    for i in range(w, m):                                         # steady: F i, then B i-w
        grad = p2p(forward(i, inp), pipe.next, pipe.next)             # send F i's output, get B i-w's gradient
        more = i + 1 < m
        inp = p2p(backward(grad), pipe.prev, pipe.prev if more else None)   # send B i-w's, get F i+1's input
        inp = xs[i + 1] if stage.is_first and more else inp
    for _ in range(w):                                            # cool-down
        p2p(backward(p2p(recv_from=pipe.next)), pipe.prev)
    return torch.stack(losses).mean() if stage.is_last else None


# ---- 2. what one rank holds: a Stage of the shared model --------------------------------------------

class Stage(Transformer):
    """Rank r's part of the shared Transformer: its v chunks, the virtual stages r, r+p, .., r+(v-1)p of
    p·v (v = 1: stage r of p). Parameters keep the full model's names (layers.5.attn.wq.weight), so
    each is initialised as in the whole model; other ranks' layers are never allocated. A subclass of
    model.Transformer for its forward's pieces (blocks, head): a stage runs the model's own code."""

    def __init__(self, cfg, r: int, p: int, seed: int = 0, device=None, dtype=torch.float32, v: int = 1):
        nn.Module.__init__(self)  # not Transformer.__init__: that would allocate every layer
        self.cfg, self.v, self.is_first, self.is_last = cfg, v, r == 0, r == p - 1
        self.chunks = [list(split_layers(cfg.n_layers, p * v)[c * p + r]) for c in range(v)]  # layer ids
        with torch.device("meta"):                                                          # shapes only
            full = Transformer(cfg, seed=None)
        # a tied head is the embedding's matrix: the last stage holds a copy under the same name (section 7)
        self.tok_embeddings = full.tok_embeddings if self.is_first or self.is_last and cfg.tie_embeddings else None
        for name in ("pos_embeddings", "embed_norm"):  # learned positions, BLOOM's embedding norm
            if self.is_first and hasattr(full, name):
                setattr(self, name, getattr(full, name))
        self.layers = nn.ModuleDict({str(i): full.layers[i] for ids in self.chunks for i in ids})
        if self.is_last:
            self.norm, self.output, self.loss_fn = full.norm, full.output, full.loss_fn
        self.to_empty(device=device or "cpu")
        self.tie_weights()  # (to_empty made new parameters)
        if torch.device(device or "cpu").type != "meta":  # (meta: shapes only, for a memory plan)
            with torch.no_grad():
                for name, prm in self.named_parameters():
                    prm.copy_(init_tensor(cfg, name, tuple(prm.shape), seed))
        self.to(dtype)
        self.positions = None  # absolute token positions [S] (a context-parallel shard); None: 0..S-1

    def forward(self, x, targets=None, positions=None, chunk: int = 0):
        """tokens [b, S] (chunk 0 of rank 0) or activations [b, S, H] -> [b, S, H]; the last chunk of
        the last rank returns logits [b, S, V], or the mean loss if targets are given."""
        pos = positions if positions is not None else self.positions
        if self.is_first and chunk == 0:
            h = self.embed(x, pos if pos is not None else torch.arange(x.shape[1], device=x.device))
        else:
            h = x
        pos = pos if pos is not None else torch.arange(h.shape[1], device=h.device)
        h = self.blocks(h, [self.layers[str(i)] for i in self.chunks[chunk]], pos)
        return self.head(h, targets) if self.is_last and chunk == self.v - 1 else h

    def aux_loss(self, chunk: int = 0):
        """The MoE auxiliary loss of this chunk's last forward (as model.Transformer.aux_loss), or None."""
        aux = [self.layers[str(i)].mlp.aux_loss for i in self.chunks[chunk] if isinstance(self.layers[str(i)].mlp, MoE)]
        return sum(aux) if aux else None


# ---- 3. schedules as data: the actions, and the builders that order them ---------------------------

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


def split_layers(n_layers: int, n: int) -> list[range]:
    """Layer indices of each of n stages, balanced; the first n_layers % n take one more (the last
    stage already carries the head and the loss, the first only an embedding lookup)."""
    base, extra = divmod(n_layers, n)
    sizes = [base + (s < extra) for s in range(n)]
    return [range(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(n)]


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


# ---- 4. the checker: proving a schedule complete and free of deadlock, without a process -----------

def comm_batches(actions: list[Action]) -> list[list[Action]]:
    """Each compute alone, each run of consecutive transfers together (one batch_isend_irecv)."""
    groups = []
    for a in actions:
        if a.op not in COMPUTE and groups and groups[-1][0].op not in COMPUTE:
            groups[-1].append(a)
        else:
            groups.append([a])
    return groups



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


# ---- 5. the runner: any schedule, one step ------------------------------------------------------------

def pipeline_step(stage: Stage, actions: list[Action], pipe: PipeGroup, x, y, m: int, *,
                  trace=lambda group: nullcontext(), before_last_backward=None) -> dict:
    """One forward+backward of the local batch x, y [B, S] (y: the last rank's targets) through this
    rank's actions; leaves the full-batch gradients in .grad (no optimizer step, no zero_grad).
    A stage boundary carries one micro-batch's [B/m, S, H] ([B/m, S/tp, H] once tensor_parallel made the
    stage sequence parallel). trace(group): a context manager entered around each group of actions (a
    compute alone, consecutive transfers together): the place to measure from, outside.
    before_last_backward(): called right before the last action that adds to this rank's parameter
    gradients (its last B; its last W under zero bubble) — data parallel's buckets may all-reduce during it.
    Returns dict(loss: the mean loss on the last rank, else None; aux: the MoE aux loss of this rank's
    layers, averaged over micro-batches — add it to the reported loss — or None)."""
    shape, dtype = boundary_shape(stage, x, m), next(stage.parameters()).dtype
    xs, ys = x.chunk(m), (y.chunk(m) if stage.is_last else None)
    split = any(a.op == "W" for a in actions)
    if split:
        split_linears(stage)
    inputs, outputs, grads, deferred, losses, aux = {}, {}, {}, {}, [], []

    def forward(a, key, first, last):
        out = stage(xs[a.mb] if first else inputs[key], ys[a.mb] if last else None, chunk=a.chunk)
        extra = stage.aux_loss(a.chunk)   # MoE layers: their aux loss is part of this micro-batch's loss
        outputs[key] = [out / m if last else out] + ([extra / m] if extra is not None else [])   # (1/m: see doc)
        losses.extend([out.detach()] if last else [])
        aux.extend([extra.detach()] if extra is not None else [])

    def backward(key, last, split):   # (a sent activation's values are freed, see transfer: its graph is enough)
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
            k, peer = (t.mb, t.chunk), pipe.peer(+1 if t.op in ("SEND_F", "RECV_B") else -1)
            if t.op.startswith("SEND"):   # (contiguous: a sequence-parallel [b, S/t, H] is a transposed view)
                data = outputs[k][0] if t.op == "SEND_F" else inputs.pop(k).grad
                sent += [data] if t.op == "SEND_F" else []
                ops.append(dist.P2POp(dist.isend, data.contiguous(), peer))
            else:
                buf = (inputs if t.op == "RECV_F" else grads)[k] = torch.empty(shape, dtype=dtype, device=x.device)
                ops.append(dist.P2POp(dist.irecv, buf, peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for t in sent:   # sent, not needed again: the stage ends in a residual add, which saves no
            t.untyped_storage().resize_(0)   # output, so its backward needs only the graph
        for t in (t for t in group if t.op == "RECV_F"):
            inputs[(t.mb, t.chunk)].requires_grad_()   # so its gradient can be sent back

    groups = comm_batches(actions)
    whole = unsplit_backwards(groups)
    final_grads = last_gradient_group(groups, split, whole)
    for i, group in enumerate(groups):
        a, key = group[0], (group[0].mb, group[0].chunk)
        if i == final_grads and before_last_backward is not None:
            before_last_backward()
        first, last = stage.is_first and a.chunk == 0, stage.is_last and a.chunk == stage.v - 1
        split_here = split and key not in whole and a.op in ("F", "B")
        with trace(group), DeferWeightGrads(stage, deferred.setdefault(key, [])) if split_here else nullcontext():
            if a.op == "F":
                forward(a, key, first, last)
            elif a.op == "B":
                backward(key, last, split_here)
            elif a.op == "W":
                weight_grads(deferred.pop(key, []))
            else:
                transfer(group)
    return dict(loss=torch.stack(losses).sum() / m if losses else None, aux=torch.stack(aux).sum() / m if aux else None)


def boundary_shape(stage, x, m: int) -> tuple:
    """What crosses a stage boundary per micro-batch: [B/m, S, H], or [B/m, S/tp, H] once tensor_parallel made
    the stage sequence parallel."""
    sp = getattr(stage, "sequence_parallel", False)
    return x.shape[0] // m, x.shape[1] // (dist.get_world_size(stage.tp_group) if sp else 1), stage.cfg.dim


def unsplit_backwards(groups) -> set:
    """Zero bubble: the (micro-batch, chunk) of each B whose W comes next, nothing between (the first stage's: no
    one waits for its input gradient). Splitting it gains nothing: it runs as one ordinary backward and its W has
    nothing left to do."""
    return {(g[0].mb, g[0].chunk) for g, h in zip(groups, groups[1:])
            if g[0].op == "B" and h[0].op == "W" and (g[0].mb, g[0].chunk) == (h[0].mb, h[0].chunk)}


def last_gradient_group(groups, split: bool, whole: set):
    """The index of the group whose action adds to the parameters' .grad last — a B that runs whole (a split B
    leaves .grad to its W), or a W with something left to do — where data parallel's buckets may start their
    all-reduce during it (before_last_backward); None if there is none."""
    return max((i for i, g in enumerate(groups)
                if g[0].op == "B" and (not split or (g[0].mb, g[0].chunk) in whole)
                or g[0].op == "W" and (g[0].mb, g[0].chunk) not in whole), default=None)


# ---- 6. zero bubble: B and W apart, in autograd ------------------------------------------------------

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


class DeferWeightGrads:
    """`with DeferWeightGrads(module, deferred):` — inside it, every linear layer of `module` that split_linears
    reached, on a trainable weight and a differentiable input, computes only dL/dx in backward, and leaves its
    (x, dL/dy) in `deferred`; weight_grads(deferred) does the rest. Where the linears look: the module's own
    switch, the stack of `deferred` lists entered and not left, which split_linears put on it — no global, so two
    models never see each other's; activation checkpointing's recompute, which autograd runs in backward,
    outside the forward's `with`, reads the same switch."""

    def __init__(self, module: nn.Module, deferred: list):
        if not hasattr(module, "deferring_weight_grads"):
            raise ValueError("DeferWeightGrads(module, ...) needs split_linears(module) first: it routes the "
                             "module's linear layers through the switch this context sets")
        self.switch, self.deferred = module.deferring_weight_grads, deferred

    def __enter__(self):
        self.switch.append(self.deferred)
        return self

    def __exit__(self, *exc):
        self.switch.remove(self.deferred)


def deferring_linear(x, w, b=None, *, switch: list):
    """F.linear — unless a `deferred` list is on the switch, the weight trainable and the input differentiable:
    then one whose backward returns dL/dx only (_InputGradOnly), leaving (x, dL/dy) in the innermost list."""
    if not (switch and torch.is_grad_enabled() and x.requires_grad and w.requires_grad):
        return F.linear(x, w, b)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):   # cast as autocast would, outside the Function
        x, w, b = (t if t is None else t.to(torch.get_autocast_dtype(dev)) for t in (x, w, b))
    with torch.autocast(dev, enabled=False):
        return _InputGradOnly.apply(x, (w, b), switch[-1])


def split_linears(module: nn.Module) -> nn.Module:
    """Route every linear layer of `module` through deferring_linear — an nn.Linear's forward, or the `linear`
    a layer calls (tensor_parallel's Column/RowParallelLinear) — in place, once, all on one switch kept on the
    module (`module.deferring_weight_grads`, which DeferWeightGrads sets); outside DeferWeightGrads they compute
    as before. (A layer whose matmul was swapped already, a float8 one, is left alone: B computes its weight
    gradient.) Swapping the layers once costs nothing per op, where a TorchFunctionMode watching every torch
    call would run Python on every op."""
    if not hasattr(module, "deferring_weight_grads"):
        module.deferring_weight_grads = []
    linear = functools.partial(deferring_linear, switch=module.deferring_weight_grads)
    for m in module.modules():
        if isinstance(m, nn.Linear) and "forward" not in vars(m):
            m.forward = lambda x, m=m: linear(x, m.weight, m.bias)
        elif getattr(m, "linear", None) is F.linear:
            m.linear = linear
    return module


class _WeightGrads(torch.autograd.Function):
    """One autograd node per deferred linear (and one for the gradients B computed), whose inputs are its
    parameters: its backward computes their gradients and autograd accumulates them as in an ordinary backward —
    into .grad, each post-accumulate-grad hook once. Why nodes: autograd copies a ready-made gradient handed to
    torch.autograd.backward(params, grads), not one a node returns; why one per linear: autograd consumes each
    gradient before the next is made, so a stage's weight gradients never all live at once."""

    @staticmethod
    def forward(ctx, item: list, *params):   # item: [what backward computes from], emptied there
        ctx.item = item
        return params[0].new_zeros(())   # a scalar to call backward on

    @staticmethod
    def backward(ctx, _):
        item = ctx.item.pop()
        if len(item) == 1:   # [gradients computed in B: norms, the embedding]
            return (None, *item[0])
        x, gy, _, b = item
        gy2 = gy.reshape(-1, gy.shape[-1])   # [tokens, out]
        return (None, gy2.T @ x.reshape(-1, x.shape[-1])) + ((gy2.sum(0),) if b is not None else ())


def weight_grads(deferred: list) -> None:
    """W: dL/dW = dL/dy^T x (and dL/db = sum of dL/dy) of each deferred linear — plus any (parameter,
    gradient) B already had — handed to autograd in one backward, so .grad and post-accumulate-grad hooks
    (ZeRO, DDP) see one ordinary backward per micro-batch."""
    pairs, linears = [d for d in deferred if len(d) == 2], [d for d in deferred if len(d) == 4]
    deferred.clear()
    with torch.enable_grad():
        roots = [_WeightGrads.apply([[[g for _, g in pairs]]], *(q for q, _ in pairs))] if pairs else []
        roots += [_WeightGrads.apply([item], *(t for t in item[2:] if t is not None)) for item in linears]
    del pairs, linears   # (only the nodes hold each linear's x and dL/dy now, until theirs is computed)
    if roots:
        torch.autograd.backward(roots)


# ---- 7. for the capstone (train.py): a tied embedding on the first and the last stage ------------------
#
# A head tied to the embedding (lab/model.py's tie_embeddings: GPT-2, MPT, BLOOM) is used on the first stage (the
# lookup) and on the last (the head). Each holds a copy, made from the same values (the same name), and before the
# optimizer steps their gradients are summed between the two, so both copies take the same step and stay one
# matrix (Megatron-LM's embedding group). Per step: one all-reduce of V·H/t elements between two ranks.

def tied_embedding_groups(pp_groups: list[list[int]]):
    """For each pipeline (its global ranks, in stage order), a group of its first and last ranks. new_group is a
    collective over the whole world: every rank calls this with the same lists. Returns this rank's group (None
    for a rank between them)."""
    mine = None
    for ranks in pp_groups:
        group = dist.new_group([ranks[0], ranks[-1]])
        mine = group if dist.get_rank() in (ranks[0], ranks[-1]) else mine
    return mine


@torch.no_grad()
def sync_tied_embedding(stage, group) -> None:
    """After the step's backwards, before the optimizer: the tied matrix's gradient summed over the first and last
    stage (`group`, from tied_embedding_groups; None: nothing to do). Data parallel's reduction of it may come
    before or after: the two sums commute."""
    if group is None:
        return
    w = stage.tok_embeddings.weight
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    dist.all_reduce(w.grad, group=group)


if __name__ == "__main__":  # the demo (timelines, bubble, memory, PyTorch's schedules) is in the package
    from lab.pipeline_demo import main
    main()
