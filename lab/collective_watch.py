"""A hang is a diagnosis: every collective and transfer of a rank checked against its peers' BEFORE it runs, for grading.

Ranks pair the collectives on a group by the order they issue them and by nothing else (lesson 0), and a send
completes only when its receive is posted. A learner's code that makes one more collective on one rank, another
size, another order, or a send nobody receives, would abort gloo, swap data silently, or wait out the collective
timeout (minutes). With `install()` every collective of `torch.distributed` (all_reduce, broadcast, the all-gathers,
the reduce-scatters, the all-to-alls, barrier) first says in one line what it is about to do, through the job's
key-value store (as mesh.agree; not a collective, so the bytes on the wire are unchanged), and waits for its
group's lines; transfers (batch_isend_irecv, send, recv) publish each send and receive and wait for the other side's.
Then, within `patience` seconds and usually within a fraction of one, every rank stops with one message:

    the lines differ         each rank's collective named (op, size, dtype, group), and what differs
    an all-to-all's splits   "rank 0 sends 7 rows to rank 1, which expects 5 from it"
    a transfer's sizes       the send and the receive named, with both sizes
    a deadlock               every rank named with what it waits for, when each waits on a peer that waits
                             elsewhere (two ranks both sending first: "post a send with the receive it waits for")
    a peer that left         it raised (its error named) or finished the check without this collective
    a peer that never came   after `patience` s: its last collective on the group, and that it is not waiting at one

Grading calls begin_check() and end_check() around each check, identically on every rank: keys are scoped by
the check, so a check that failed half-way leaves nothing behind for the next. `events` logs this rank's
collectives (op, group, elements, dtype, asynchronous?, inside backward?) for the checks' formulas.
Install BEFORE importing the lessons (mesh.py binds all_gather_single at import); install() also re-points
names already bound in the course's modules.
"""
from __future__ import annotations

import inspect
import json
import sys
import time

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "broadcast", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_to_all_single", "all_gather", "reduce_scatter", "all_to_all", "barrier")
TRANSFERS = ("batch_isend_irecv", "send", "recv")
_ORIGINAL: dict[str, object] = {}
_S = dict(check=0, seq={}, sent={}, received={}, n=0, patience=10.0, events=[], probe=None)
events: list[dict] = _S["events"]


class CollectiveMismatch(RuntimeError):
    """The ranks' collectives or transfers do not match (or a peer never came): the message says how."""


class PeerLeft(CollectiveMismatch):
    """A peer left the check (it raised, or finished) while this rank waited for it at a collective."""


# ---- install / uninstall --------------------------------------------------------------------------------------

def _course_modules():
    return [m for name, m in list(sys.modules.items()) if m is not None and (
        name in ("mesh", "ddp", "fsdp", "hsdp", "tensor_parallel", "pipeline", "ring_attention", "expert_parallel",
                 "train") or name.startswith(("lab.", "yours_")))]


def _repoint(old, new) -> None:
    for m in _course_modules():
        for k, v in list(vars(m).items()):
            if v is old:
                setattr(m, k, new)


def install(patience: float = 10.0) -> None:
    """Wrap torch.distributed's collectives and transfers (and the names the course's modules bound to them)."""
    _S["patience"] = float(patience)
    if _ORIGINAL:
        return
    for name in COLLECTIVES + TRANSFERS:
        orig = getattr(dist, name, None)
        if orig is None:
            continue
        _ORIGINAL[name] = orig
        wrapped = _wrap(name, orig)
        setattr(dist, name, wrapped)
        _repoint(orig, wrapped)


def uninstall() -> None:
    for name, orig in _ORIGINAL.items():
        wrapped = getattr(dist, name)
        setattr(dist, name, orig)
        _repoint(wrapped, orig)
    _ORIGINAL.clear()


def _wrap(name, orig):
    sig = inspect.signature(orig)

    def wrapped(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if name in TRANSFERS:
            _transfers(name, a)
        else:
            _collective(name, a)
        return orig(*args, **kwargs)
    wrapped.__name__, wrapped.__doc__, wrapped.__wrapped__ = name, orig.__doc__, orig
    return wrapped


# ---- describing a call ---------------------------------------------------------------------------------------

def _dt(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _describe(name, a) -> dict:
    """{op (instruments.CommCounter's names), line (what every rank of the group must say alike), numel, dtype,
    bytes (API bytes, CommCounter's convention), and for all-to-alls the splits}."""
    op = name.replace("_into_tensor", "").replace("_tensor", "").replace("_single", "")
    rec = dict(op=op, asynchronous=bool(a.get("async_op")))
    if op == "all_reduce":
        t = a["tensor"]
        red = str(a["op"]).split(".")[-1].lower()
        rec.update(numel=t.numel(), dtype=_dt(t), bytes=_nb(t), line=f"all_reduce ({red}) of {t.numel():,} {_dt(t)} elements")
    elif op == "broadcast":
        t = a["tensor"]
        rec.update(numel=t.numel(), dtype=_dt(t), bytes=_nb(t),
                   line=f"broadcast of {t.numel():,} {_dt(t)} elements from rank {a.get('src', a.get('group_src'))}")
    elif op == "all_gather" and "input_tensor" in a:
        i, o = a["input_tensor"], a["output_tensor"]
        rec.update(numel=o.numel(), dtype=_dt(i), bytes=_nb(o),
                   line=f"all_gather of {i.numel():,} {_dt(i)} elements per rank into {o.numel():,}")
    elif op == "reduce_scatter" and "input" in a:
        i, o = a["input"], a["output"]
        rec.update(numel=i.numel(), dtype=_dt(i), bytes=_nb(i),
                   line=f"reduce_scatter of {i.numel():,} {_dt(i)} elements into {o.numel():,} per rank")
    elif op == "all_to_all" and "input" in a:
        i, o = a["input"], a["output"]
        rec.update(numel=i.numel(), dtype=_dt(i), bytes=_nb(i), send=a["input_split_sizes"],
                   recv=a["output_split_sizes"], rows=(i.shape[0] if i.dim() else 1, o.shape[0] if o.dim() else 1),
                   row_bytes=_nb(i[0]) if i.dim() and i.shape[0] else 0,
                   line=f"all_to_all_single of {_dt(i)} rows of {tuple(i.shape[1:])}" if a["input_split_sizes"]
                   else f"all_to_all_single of {i.numel():,} {_dt(i)} elements")
    elif op == "all_gather":
        t = a["tensor"]
        rec.update(numel=t.numel(), dtype=_dt(t), bytes=sum(_nb(x) for x in a["tensor_list"]),
                   line=f"all_gather (list) of {t.numel():,} {_dt(t)} elements per rank")
    elif op == "reduce_scatter":
        ts = a["input_list"]
        rec.update(numel=sum(t.numel() for t in ts), dtype=_dt(ts[0]), bytes=sum(_nb(t) for t in ts),
                   line=f"reduce_scatter (list) of {[t.numel() for t in ts]} {_dt(ts[0])} elements")
    elif op == "all_to_all":
        ins, outs = a["input_tensor_list"], a["output_tensor_list"]
        rec.update(numel=sum(t.numel() for t in ins), dtype=_dt(ins[0]), bytes=sum(_nb(t) for t in ins),
                   send=[t.numel() for t in ins], recv=[t.numel() for t in outs], line=f"all_to_all (list) of "
                   f"{_dt(ins[0])} elements")
    else:  # barrier
        rec.update(numel=0, dtype="", bytes=0, line="barrier")
    return rec


def _nb(t) -> int:
    return t.numel() * t.element_size()


def _group_of(g):
    return g if g is not None else dist.group.WORLD


def _ranks(g) -> list[int]:
    return dist.get_process_group_ranks(g)


# ---- the check: one line per rank, through the store ------------------------------------------------------------

def _store():
    return dist.distributed_c10d._get_default_store()


def _key(*parts) -> str:
    return "watch/" + "/".join(str(p) for p in (_S["check"], *parts))


def _collective(name, a) -> None:
    group = _group_of(a.get("group"))
    if not dist.is_initialized() or dist.get_backend(group) not in ("gloo", "nccl"):
        return
    rec = _describe(name, a)
    if rec.get("send") is not None or rec.get("recv") is not None:
        _check_own_splits(rec)
    ranks = _ranks(group)
    me = dist.get_rank()
    rec.update(group=ranks, index=ranks.index(me) if me in ranks else None, t=time.monotonic(),
               in_backward=torch._C._current_graph_task_id() != -1)
    if _S["probe"] is not None:
        _S["probe"](rec)
    events.append(rec)
    if len(ranks) == 1 or me not in ranks:
        return
    gname = group.group_name
    seq = _S["seq"][gname] = _S["seq"].get(gname, -1) + 1
    _S["n"] += 1
    mine = dict(line=rec["line"], send=rec.get("send"), recv=rec.get("recv"), rows=rec.get("rows"), seq=seq)
    store = _store()
    store.set(_key("c", gname, seq, me), json.dumps(mine))
    keys = [_key("c", gname, seq, r) for r in ranks]
    where = f"{rec['line']} over ranks {ranks} (its collective #{seq + 1} there)"
    _wait(keys, ranks, where, lambda r: _last_line(gname, seq, r))
    said = {r: json.loads(v) for r, v in zip(ranks, store.multi_get(keys))}
    lines = {r: s["line"] for r, s in said.items()}
    if len(set(lines.values())) > 1:
        raise CollectiveMismatch(_differ(ranks, said))
    if rec.get("send") is not None or rec.get("recv") is not None:
        _check_splits(ranks, said, rec)


def _last_line(gname, seq, r) -> str:
    key = _key("c", gname, seq - 1, r)
    return json.loads(_store().get(key))["line"] if seq and _store().check([key]) else "none yet"


def _differ(ranks, said) -> str:
    lines = {r: s["line"] for r, s in said.items()}
    ops = {line.split(" ")[0] for line in lines.values()}
    what = ("different collectives: the ranks make theirs in a different order, or one rank makes one more or one "
            "fewer" if len(ops) > 1 else "the same collective with different sizes (or dtypes): every rank must hand "
            "over the same shape")
    return (f"the ranks of group {ranks} disagree on their collective #{said[ranks[0]]['seq'] + 1} there — "
            + "; ".join(f"rank {r}: {lines[r]}" for r in ranks) + f" — {what}")


def _check_own_splits(rec) -> None:
    """An all-to-all's splits must describe this rank's own tensors (checked here, before any peer is involved)."""
    for which, i, rows in (("input", "send", rec["rows"][0]), ("output", "recv", rec["rows"][1])):
        splits = rec.get(i)
        if splits is not None and "row_bytes" in rec and sum(splits) != rows:
            raise RuntimeError(f"all_to_all_single: the {which} has {rows} rows but {which}_split_sizes {list(splits)} "
                               f"add up to {sum(splits)}: the splits must describe this rank's own {which} (rows sent "
                               f"to rank j: input_split_sizes[j]; received from rank i: output_split_sizes[i])")


def _check_splits(ranks, said, rec) -> None:
    """An all-to-all with splits: what rank i sends to j must be what j expects from i."""
    P = len(ranks)
    for i in ranks:
        for jj, j in enumerate(ranks):
            ii = ranks.index(i)
            si, rj = said[i].get("send"), said[j].get("recv")
            rows_i, rows_j = said[i].get("rows") or (0, 0), said[j].get("rows") or (0, 0)
            sends = si[jj] if si else rows_i[0] // P
            expects = rj[ii] if rj else rows_j[1] // P
            if sends != expects:
                raise CollectiveMismatch(
                    f"all_to_all_single over ranks {ranks}: rank {i} sends {sends} rows to rank {j}, which expects "
                    f"{expects} from it (rank {i}'s input_split_sizes {si}, rank {j}'s output_split_sizes {rj}) — "
                    f"every split must be a number the sending rank produced and the receiver was told")


# ---- transfers: each send meets its receive ---------------------------------------------------------------------

def _transfers(name, a) -> None:
    if not dist.is_initialized():
        return
    if name == "batch_isend_irecv":
        ops = [("send" if op.op is dist.distributed_c10d.isend else "recv", op.tensor, op.peer) for op in a["p2p_op_list"]]
    elif name == "send":
        ops = [("send", a["tensor"], a["dst"] if a["dst"] is not None else
                dist.get_global_rank(a["group"], a["group_dst"]))]
    else:
        ops = [("recv", a["tensor"], a["src"] if a["src"] is not None else
                dist.get_global_rank(a["group"], a["group_src"]))]
    me, store, keys, peers, mine = dist.get_rank(), _store(), [], [], []
    for kind, t, peer in ops:
        pair = (me, peer) if kind == "send" else (peer, me)
        book = _S["sent" if kind == "send" else "received"]
        k = book[pair] = book.get(pair, -1) + 1
        what = f"{t.numel():,} {_dt(t)} elements {tuple(t.shape)}"
        store.set(_key("p", f"{pair[0]}>{pair[1]}", k, kind), json.dumps(dict(what=what, numel=t.numel(), dtype=_dt(t))))
        other = "recv" if kind == "send" else "send"
        keys.append(_key("p", f"{pair[0]}>{pair[1]}", k, other))
        peers.append(peer)
        mine.append((kind, t, peer, k, what))
        rec = dict(op=kind, group=[me, peer], numel=t.numel(), dtype=_dt(t), asynchronous=name != "send", bytes=_nb(t),
                   in_backward=torch._C._current_graph_task_id() != -1, t=time.monotonic(), line=what)
        if _S["probe"] is not None:
            _S["probe"](rec)
        events.append(rec)
    _S["n"] += 1
    where = "; ".join(f"{'to send' if kind == 'send' else 'to receive'} {what} {'to' if kind == 'send' else 'from'} "
                      f"rank {peer} ({kind} #{k + 1} from {me if kind == 'send' else peer} to "
                      f"{peer if kind == 'send' else me})" for kind, t, peer, k, what in mine)
    _wait(keys, peers, "waits " + where, lambda r: "its transfers so far")
    for (kind, t, peer, k, what), v in zip(mine, store.multi_get(keys)):
        theirs = json.loads(v)
        if (theirs["numel"], theirs["dtype"]) != (t.numel(), _dt(t)):
            s, r = (me, peer) if kind == "send" else (peer, me)
            sent, room = (what, theirs["what"]) if kind == "send" else (theirs["what"], what)
            raise CollectiveMismatch(f"rank {s} sends {sent} to rank {r} (send #{k + 1} from {s} to {r}), but rank "
                                     f"{r}'s receive #{k + 1} from rank {s} has room for {room}: a transfer's two "
                                     f"sides must agree on its size")


# ---- waiting, with the deadlock and the missing peer named -------------------------------------------------------

def _state(r):
    key = _key("s", r)
    return json.loads(_store().get(key)) if _store().check([key]) else None


def _wait(keys, ranks, where, last_of) -> None:
    """Wait until every key is set; meanwhile publish what I wait for, and raise as soon as the wait cannot end."""
    store, me, start = _store(), dist.get_rank(), time.monotonic()
    nap, blocked, seen, next_look = 0.0002, False, None, start + 0.05
    while True:
        # poll (store.wait with a short timeout would log a warning at every expiry): soon, then less often
        if store.check(keys):
            break
        time.sleep(nap)
        nap = min(0.02, nap * 2)
        if time.monotonic() < next_look:
            continue
        next_look = time.monotonic() + 0.2
        missing = [(r, k) for r, k in zip(ranks, keys) if not store.check([k])]
        if not missing:
            break
        state = dict(state="blocked", where=where, n=_S["n"], waits=[[r, k] for r, k in missing])
        store.set(_key("s", me), json.dumps(state))
        blocked = True
        if store.check([_key("verdict")]):
            raise CollectiveMismatch(store.get(_key("verdict")).decode())
        for r, _ in missing:
            s = _state(r)
            if s is not None and s["state"] == "done":
                how = f"it raised {s['error']}" if s.get("error") else "it finished the check"
                raise PeerLeft(f"rank {me} {_strip(where)}, but rank {r} left without it ({how}); its "
                                         f"last: {s['where']}. Every rank must make the same collectives and "
                                         f"transfers, in the same order")
        cycle = _deadlock(me)
        if cycle is not None and cycle == seen:
            msg = ("deadlock: every rank here waits for a peer that waits elsewhere — "
                   + "; ".join(f"rank {r} {_strip(s['where'], 'waits at ')}, waiting for rank(s) "
                               f"{[w for w, _ in s['waits']]}" for r, s in sorted(cycle.items())) + ". "
                   + _advice(cycle) + f" (found after {time.monotonic() - start:.2f} s)")
            store.set(_key("verdict"), msg)
            raise CollectiveMismatch(msg)
        seen = cycle
        if time.monotonic() - start > _S["patience"]:
            who = "; ".join(f"rank {r} never reached it (its last: {last_of(r)}; it is not waiting at a collective "
                            f"or transfer: still computing, or in an endless loop?)" for r, _ in missing)
            raise CollectiveMismatch(f"rank {me} {_strip(where)}, but {who} within {_S['patience']:.0f} s")
    if blocked:
        store.set(_key("s", me), json.dumps(dict(state="running", where=where, n=_S["n"], waits=[])))


def _strip(where, prefix="waits at "):
    return where if where.startswith("waits ") else prefix + where


def _advice(cycle) -> str:
    if all("to send" in s["where"] and "to receive" not in s["where"] for s in cycle.values()):
        return ("A send completes only when its receive is posted, and none of these ranks posts one: post each "
                "send together with the receive it waits for (one batch_isend_irecv).")
    return "Every rank must make the same collectives and transfers in the same order."


def _deadlock(me):
    """{rank: state} of every rank I (transitively) wait for, if all of them wait for keys nobody can set; else None."""
    store, todo, seen = _store(), [me], {}
    while todo:
        r = todo.pop()
        if r in seen:
            continue
        s = _state(r)
        if s is None or s["state"] == "running":
            return None
        if s["state"] == "blocked":
            if any(store.check([k]) for _, k in s["waits"]):
                return None  # what it waited for has come: it is moving on
            todo += [w for w, _ in s["waits"]]
        seen[r] = s
    return {r: s for r, s in seen.items() if s["state"] == "blocked"} or None


# ---- one check after another ---------------------------------------------------------------------------------------

def begin_check() -> None:
    """Before a check, on every rank alike: fresh keys, counters and events."""
    _S["check"] += 1
    _S["seq"].clear(), _S["sent"].clear(), _S["received"].clear()
    events.clear()
    _S["probe"] = None


def set_probe(fn) -> None:
    """fn(event) is called on every event as it is logged (a check adds what it measures, e.g. gradients so far)."""
    _S["probe"] = fn


def end_check(error: str | None, wait: float | None = None) -> dict:
    """After a check: say I am done (and how), and wait (at most `wait` s, default patience + 5) for every rank to be
    done. Returns {rank: its error or None}, the same on every rank (one not done in time: "never finished the
    check")."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {0: error}
    store, me, P = _store(), dist.get_rank(), dist.get_world_size()
    last = events[-1]["line"] if events else "none"
    store.set(_key("s", me), json.dumps(dict(state="done", error=error, where=last, n=_S["n"], waits=[])))
    deadline = time.monotonic() + (_S["patience"] + 5 if wait is None else wait)
    while True:
        states = {r: _state(r) for r in range(P)}
        if all(s is not None and s["state"] == "done" for s in states.values()):
            return {r: s["error"] for r, s in states.items()}
        if time.monotonic() > deadline:
            return {r: s["error"] if s and s["state"] == "done" else "never finished the check" for r, s in states.items()}
        time.sleep(0.01)
