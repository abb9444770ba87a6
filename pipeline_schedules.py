"""Schedules as data: the order of a pipeline step's forwards, backwards and transfers, built,
checked and played in time without starting a process (pipeline.py runs them).

A pipeline step (pipeline.py: p stages, one per rank; m micro-batches) is the same work under every
schedule. What a schedule decides is the ORDER on each rank of its forwards (F), its backwards (B) —
split, for zero bubble, into B, the input gradient dL/dx that the stage before is waiting for, and W,
the weight gradient that nobody waits for — and of its transfers to and from its neighbours. Here a
schedule is data: `SCHEDULES[name](p, m, v)` gives each rank a list of Actions (F3, RECV_B2, SEND_F5.1
for chunk 1), built by pure functions; `check_schedule` proves every list complete and consistent
with its neighbours'; `simulate` plays them in time and finds any deadlock; `pipeline.pipeline_step`
runs any of them unchanged; `split_layers` and `validate` are the arithmetic every rank does alike
before the first send. `python pipeline_schedules.py --p 4 --m 8` prints them all, played in time.

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
activations held, so m can grow. It also runs with m < p (warm-up min(p-r-1, m)). Interleaved crosses
p·v-1 stage boundaries instead of p-1: about v× the point-to-point traffic.

A transfer is a rendezvous (gloo's send waits for its receive; NCCL groups make it so), so both sides
must reach it together. Transfers between two computes go in ONE batch (Megatron's
send_forward_recv_backward and kin); `simulate` plays every schedule under exactly that rule.
"""
from __future__ import annotations

from dataclasses import dataclass


# ---- the actions, and the schedules that order them ------------------------------------------------

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


# ---- checking and playing a schedule without running it ------------------------------------------

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


def idle_formula(name: str, p: int, m: int, v: int = 1, t_f=1, t_b=1, t_w=1):
    """Each rank's idle time per step, from the papers (see the docstring); None for a schedule they do not cover."""
    full = (p - 1) * (t_f + t_b + t_w)
    return {"gpipe": full, "1f1b": full, "interleaved": full / v,
            "zb": (p - 1) * (t_f + t_b) - (min(m, p) - 1) * t_w}.get(name)


def held_formula(name: str, p: int, m: int, r: int, v: int = 1) -> int | None:
    """Micro-batches (interleaved: chunk-micro-batches) rank r holds at its peak; None as above."""
    return {"gpipe": m, "1f1b": min(p - r, m), "zb": min(p, m),
            "interleaved": min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)}.get(name)


# ---- demo: every schedule printed and played, next to its formulas (no ranks needed) ---------------

def _demo(argv=None) -> int:
    import argparse
    import os
    from fractions import Fraction

    from instruments import ascii_timeline
    ap = argparse.ArgumentParser(description="every schedule's actions, played in time next to its formulas")
    ap.add_argument("--p", type=int, default=4, help="pipeline ranks")
    ap.add_argument("--m", type=int, default=8, help="micro-batches")
    ap.add_argument("--v", type=int, default=2, help="chunks per rank of the interleaved schedule")
    ap.add_argument("--times", type=Fraction, nargs=3, default=[1, 1, 1], metavar=("F", "B", "W"),
                    help="t_f t_b t_w of one micro-batch on one stage (an unsplit backward takes t_b + t_w)")
    ap.add_argument("--transfers", action="store_true", help="list the transfers too: [one batch of them]")
    args = ap.parse_args(argv)
    p, m, t = args.p, args.m, args.times
    if p < 1 or m < 1 or min(t) <= 0:
        raise ValueError(f"need --p >= 1, --m >= 1 and positive --times, got p={p}, m={m}, times={t}")
    if os.environ.get("RANK", "0") != "0":   # under torchrun: rank 0 prints, the others have nothing to add
        return 0
    print(f"p={p} ranks, m={m} micro-batches, t_f:t_b:t_w = {':'.join(map(str, t))} (F forward, B backward, "
          f"W weight gradient, . idle)")
    for name, build in SCHEDULES.items():
        v = args.v if name == "interleaved" else 1
        try:
            validate(p, m, p * v, m, name, v)
        except ValueError as e:
            print(f"\n{name}: {e}")
            continue
        sched = build(p, m, v)
        check_schedule(sched)
        sim = simulate(sched, *t)
        print(f"\n{name}" + (f" (v={v} chunks per rank)" if v > 1 else "") + ": each rank's actions"
              + ("" if args.transfers else " (computes; --transfers for all)"))
        for r, acts in enumerate(sched):
            print(f"  rank {r}  " + " ".join(repr(g[0]) if g[0].op in COMPUTE else f"[{' '.join(map(repr, g))}]"
                                           for g in comm_batches(acts) if args.transfers or g[0].op in COMPUTE))
        print(ascii_timeline([[dict(name=a.op, start=s, end=e) for a, s, e in spans] for spans in sim["spans"]],
                             width=min(120, round(2 * sim["total"]))))   # 2 characters per unit of time
        idle = idle_formula(name, p, m, v, *t)
        bubble = sorted(set(sim["bubble"]))
        held = [held_formula(name, p, m, r, v) for r in range(p)]
        print("  bubble (idle share of the step): simulated " + " ".join(f"{float(b):.3f}" for b in bubble)
              + ", formula " + ("-" if idle is None else f"{float(idle / (m * sum(t) + idle)):.3f}")
              + "\n  micro-batches held at the peak per rank: simulated " + " ".join(map(str, sim["peak_in_flight"]))
              + ", formula " + ("-" if None in held else " ".join(map(str, held)))
              + (f" (chunk-micro-batches, each 1/{v} of a stage's)" if v > 1 else ""))
    return 0


if __name__ == "__main__":
    from demo import main
    main(_demo)
