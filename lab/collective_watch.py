"""A hang is a diagnosis: every collective and transfer of a rank checked against its peers' BEFORE it runs.

Ranks pair the collectives on a group by the order they issue them and by nothing else (lesson 0), and a send
completes only when its receive is posted. A learner's code that makes one more collective on one rank, another
size, another order, or a send nobody receives, would abort gloo, swap data silently, or wait out the collective
timeout (minutes). With `install()`:

- every collective of `torch.distributed` (all_reduce, broadcast, the all-gathers, the reduce-scatters, the
  all-to-alls, barrier) first says in one line what it is about to do, through the job's key-value store (as
  mesh.agree; not a collective, so the bytes on the wire are unchanged), and waits for its group's lines;
- every transfer (whatever call posts it: isend, irecv, send, recv, batch_isend_irecv, P2POp — all reach a process
  group's send and recv) publishes its side when it is posted and does not wait there: the n-th send from rank s to
  rank d on a group and tag meets d's n-th receive from s, whatever batch or call each sits in, as gloo matches
  them. A rank waits where it really waits — the returned work's wait(), or inside a blocking send/recv — and
  there the watch waits first for the other side to be posted, then for gloo, at most `patience` + 5 s.

Then, within `patience` seconds and usually within a fraction of one, every rank stops with one message:

    the lines differ         each rank's collective named (op, size, dtype, group), and what differs
    an all-to-all's splits   "rank 0 sends 7 rows to rank 1, which expects 5 from it"
    a transfer's sizes       the send and the receive named, with both sizes (refused before gloo sees both sides:
                             gloo aborts the receiving process when more bytes arrive than it posted room for)
    a deadlock               every rank named with what it waits for and its other transfers not yet met, when each
                             waits on a peer that waits elsewhere (two ranks both sending first: "post a send with the
                             receive it waits for")
    a peer that left         it raised (its error named) or finished the scope without this collective
    a peer that never came   after `patience` s: its last collective on the group, and that it is not waiting at one
    gloo gave up             a wait the watch let through failed inside gloo (a peer's process stopped answering):
                             GlooFailed, with what this rank waited for and from whom (explain() words gloo's errors)

Scopes: begin_check() and end_check() around a unit of work (a grading check; a training step could be one), called
identically on every rank: keys and gloo's tags are scoped, so a scope that failed half-way leaves nothing behind for
the next (a transfer posted that no peer met never meets a later one), and unusable() says when gloo itself failed
in it (a timeout closes the connection between two ranks): then the process group must be rebuilt before the next.
`events` logs this rank's collectives and transfers (op, group, elements, dtype, asynchronous?, inside backward?) for
formulas; in_flight() the asynchronous collectives not yet waited; set_drop_hook(fn) hears of one dropped in flight
(its tensors may be freed while gloo writes into them); stats() the watch's own cost (calls, seconds).
Install BEFORE importing the lessons (mesh.py binds all_gather_single at import); install() also re-points
names already bound in the course's modules.
"""
from __future__ import annotations

import datetime
import inspect
import json
import os
import sys
import time

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "broadcast", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_to_all_single", "all_gather", "reduce_scatter", "all_to_all", "barrier")
_ORIGINAL: dict[str, object] = {}
_PG_ORIGINAL: dict[str, object] = {}   # ProcessGroup.send / .recv: where every transfer is posted
_S = dict(check=0, seq={}, posted={}, pending=[], n=0, patience=10.0, events=[], probe=None, broken=None, works={},
          on_drop=None, dropped=[], calls=0, spent=0.0, unusable={})
events: list[dict] = _S["events"]


class CollectiveMismatch(RuntimeError):
    """The ranks' collectives or transfers do not match (or a peer never came): the message says how."""


class PeerLeft(CollectiveMismatch):
    """A peer left the check (it raised, or finished) while this rank waited for it at a collective."""


class GlooFailed(RuntimeError):
    """A collective or transfer the watch let through failed inside gloo: what this rank waited for, then gloo's cause
    in words (explain)."""


# ---- install / uninstall --------------------------------------------------------------------------------------

def course_modules():
    """The course's modules loaded now: the lessons, lab's, and a learner's (yours_*)."""
    return [m for name, m in list(sys.modules.items()) if m is not None and (
        name in ("mesh", "ddp", "fsdp", "hsdp", "tensor_parallel", "pipeline", "ring_attention", "expert_parallel",
                 "train") or name.startswith(("lab.", "yours_")))]


def _repoint(old, new) -> None:
    for m in course_modules():
        for k, v in list(vars(m).items()):
            if v is old:
                setattr(m, k, new)


def install(patience: float = 10.0) -> None:
    """Wrap torch.distributed's collectives (and the names the course's modules bound to them), and the process
    groups' send and recv (every transfer passes there)."""
    _S["patience"] = float(patience)
    if _ORIGINAL:
        return
    for name in COLLECTIVES:
        orig = getattr(dist, name, None)
        if orig is None:
            continue
        _ORIGINAL[name] = orig
        wrapped = _wrap(name, orig)
        setattr(dist, name, wrapped)
        _repoint(orig, wrapped)
    for kind in ("send", "recv"):
        _PG_ORIGINAL[kind] = vars(dist.ProcessGroup)[kind]   # (the method itself: uninstall puts it back as it was)
        setattr(dist.ProcessGroup, kind, _wrap_transfer(kind, getattr(dist.ProcessGroup, kind)))


def uninstall() -> None:
    for name, orig in _ORIGINAL.items():
        wrapped = getattr(dist, name)
        setattr(dist, name, orig)
        _repoint(wrapped, orig)
    for kind, orig in _PG_ORIGINAL.items():
        setattr(dist.ProcessGroup, kind, orig)
    _ORIGINAL.clear()
    _PG_ORIGINAL.clear()


def _watched(group) -> bool:
    return dist.is_initialized() and dist.get_backend(group) in ("gloo", "nccl")


def _bound() -> datetime.timedelta:
    """How long a wait the watch let through may take inside gloo: every side of it is posted by then."""
    return datetime.timedelta(seconds=_S["patience"] + 5)


def _wrap(name, orig):
    sig = inspect.signature(orig)

    def wrapped(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        t0 = time.perf_counter()
        rec = _collective(name, a)
        _S["calls"], _S["spent"] = _S["calls"] + 1, _S["spent"] + time.perf_counter() - t0
        if rec is None:
            return orig(*args, **kwargs)
        try:
            work = orig(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - gloo's own failure, said with what this rank waited for
            raise _failed(rec, e) from e
        return _Work(work, rec) if a.get("async_op") and work is not None else work
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
        rec.update(numel=t.numel(), dtype=_dt(t), bytes=_nb(t),
                   line=f"all_reduce ({red}) of {t.numel():,} {_dt(t)} elements")
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


def _collective(name, a) -> dict | None:
    """Log the collective and check it against its group's (raise if they differ); its event, None if unwatched."""
    group = _group_of(a.get("group"))
    if not _watched(group):
        return None
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
        return rec
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
    return rec


def _last_line(gname, seq, r) -> str:
    key = _key("c", gname, seq - 1, r)
    return json.loads(_store().get(key))["line"] if seq and _store().check([key]) else "none yet"


def _differ(ranks, said) -> str:
    lines = {r: s["line"] for r, s in said.items()}
    kinds = {line.split(" of ")[0] for line in lines.values()}   # the op and its reduction: "all_reduce (sum)"
    if len(kinds) > 1:
        what = ("different collectives: the ranks make theirs in a different order, or one rank makes one more or "
                "one fewer")
    elif next(iter(kinds)).startswith("all_to_all"):
        what = ("the rows differ in shape or dtype: an all-to-all's ranks may send different numbers of rows, but "
                "every row must have the same shape and dtype on every rank")
    else:
        what = ("the same collective with different sizes (or dtypes): every rank must hand over the same shape "
                "— or one rank is a collective ahead of the others")
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
    for r in ranks:
        for which in ("send", "recv"):
            splits = said[r].get(which)
            if splits is not None and len(splits) != P:
                raise CollectiveMismatch(
                    f"all_to_all_single over ranks {ranks}: rank {r}'s {'input' if which == 'send' else 'output'}"
                    f"_split_sizes {splits} name {len(splits)} ranks, the group has {P}: one split per rank of the "
                    f"group the exchange runs over")
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


# ---- transfers: each side published when posted; the wait is where a rank waits ---------------------------------

_BLOCKING = None   # the code objects of torch's blocking send and recv (a transfer they post is waited at once)


def _wrap_transfer(kind, orig):
    def wrapped(group, tensors, peer, tag=0):
        if not _watched(group):
            return orig(group, tensors, peer, tag)
        t0 = time.perf_counter()
        op = _post(group, kind, tensors[0], peer, tag)
        _S["calls"], _S["spent"] = _S["calls"] + 1, _S["spent"] + time.perf_counter() - t0
        return _Work(orig(group, tensors, peer, _scoped(group, tag)), op)
    wrapped.__name__, wrapped.__doc__, wrapped.__wrapped__ = kind, orig.__doc__, orig
    return wrapped


def _scoped(group, tag: int) -> int:
    """gloo's tag for a transfer of this scope: a side posted in an earlier scope that no peer met (the scope failed
    half-way) can never meet one of this scope's, which gloo would otherwise pair with it (same peer, same tag)."""
    if 0 <= tag < 2 ** 16 and dist.get_backend(group) == "gloo":
        return tag + (_S["check"] % 2 ** 15) * 2 ** 16
    return tag


def _blocking() -> bool:
    """Posted by torch's blocking send or recv (it calls isend or irecv, which call the group's send or recv)?"""
    global _BLOCKING
    if _BLOCKING is None:
        c10d = dist.distributed_c10d
        _BLOCKING = {inspect.unwrap(c10d.send).__code__, inspect.unwrap(c10d.recv).__code__}
    f = sys._getframe(4)   # _blocking <- _post <- the group's send/recv <- isend/irecv <- send/recv?
    return f is not None and f.f_code in _BLOCKING


def _post(group, kind, t, peer, tag) -> dict:
    """Publish this side of a transfer (kind #n on its pair, group and tag) and log it; refuse it if the other side
    is posted already with another size. Returns the op the work's wait() will match."""
    me, other = dist.get_rank(), dist.get_global_rank(group, peer)
    src, dst = (me, other) if kind == "send" else (other, me)
    pair = f"{group.group_name}/{src}>{dst}/{tag}"
    n = _S["posted"][(pair, kind)] = _S["posted"].get((pair, kind), 0) + 1
    what = f"{t.numel():,} {_dt(t)} elements {tuple(t.shape)}"
    op = dict(kind=kind, peer=other, me=me, src=src, dst=dst, n=n, what=what, numel=t.numel(), dtype=_dt(t),
              key=_key("p", pair, n, kind), other=_key("p", pair, n, "recv" if kind == "send" else "send"),
              matched=False)
    store = _store()
    store.set(op["key"], json.dumps(dict(what=what, numel=op["numel"], dtype=op["dtype"])))
    if store.check([op["other"]]):   # (published before looking: of two sides posted at once, one sees the other)
        _match(op, store)
    rec = dict(op=kind, group=[me, other], numel=t.numel(), dtype=_dt(t), asynchronous=not _blocking(), bytes=_nb(t),
               in_backward=torch._C._current_graph_task_id() != -1, t=time.monotonic(), line=what)
    if _S["probe"] is not None:
        _S["probe"](rec)
    events.append(rec)
    _S["n"] += 1
    _S["pending"].append(op)
    return op


def _say(op) -> str:
    """'to receive 512 float64 elements (2, 8, 32) from rank 1 (receive #3 from 1 to 0; rank 1 has posted 2 sends to
    rank 0)': what a rank waits for, and how far its peer got."""
    send, had = op["kind"] == "send", op["n"] - 1
    theirs = ("receive" if send else "send") + ("" if had == 1 else "s") + (" from" if send else " to")
    return (f"{'to send' if send else 'to receive'} {op['what']} {'to' if send else 'from'} rank {op['peer']} "
            f"({'send' if send else 'receive'} #{op['n']} from {op['src']} to {op['dst']}; rank {op['peer']} has "
            f"posted {had} {theirs} rank {op['me']})")


def _short(op) -> str:
    return f"{op['kind'].replace('recv', 'receive')} #{op['n']} from {op['src']} to {op['dst']}"


def _match(op, store) -> None:
    """The other side is posted: the two must agree on the size (gloo aborts a receiver sent more than it has room
    for, and leaves the rest of a larger one unwritten). Of two sides that differ, the one posted second is refused
    before gloo sees it."""
    theirs = json.loads(store.get(op["other"]))
    if (theirs["numel"], theirs["dtype"]) != (op["numel"], op["dtype"]):
        sent, room = (op["what"], theirs["what"]) if op["kind"] == "send" else (theirs["what"], op["what"])
        s, r, n = op["src"], op["dst"], op["n"]
        raise CollectiveMismatch(f"rank {s} sends {sent} to rank {r} (send #{n} from {s} to {r}), but rank {r}'s "
                                 f"receive #{n} from rank {s} has room for {room}: a transfer's two sides must agree "
                                 f"on its size")
    op["matched"] = True


def _site() -> list:
    """Where the caller is: [(file, line, function, ''), ...] innermost last, torch's and the watch's frames left out
    (cheap: no source read)."""
    out, f, torch_dir = [], sys._getframe(2), os.path.dirname(torch.__file__)
    while f is not None:
        fn = f.f_code.co_filename
        if fn != __file__ and not fn.startswith(torch_dir):
            out.append((fn, f.f_lineno, f.f_code.co_name, ""))
        f = f.f_back
    return out[::-1]


def _what(op) -> str:
    """'all_gather of 2,048 float64 elements per rank into 8,192 over ranks [0, 1]', 'send of 512 float64 elements
    (2, 8, 32) to rank 1 (send #3 from 0 to 1)'."""
    if "kind" not in op:
        return f"{op['line']} over ranks {op['group']}"
    send = op["kind"] == "send"
    return (f"{'send' if send else 'receive'} of {op['what']} {'to' if send else 'from'} rank {op['peer']} "
            f"({_short(op)})")


class _Work(dist.Work):
    """The work of a watched transfer or asynchronous collective: wait() first waits for the transfer's other side
    (the watch's wait: a deadlock or a missing peer named), then for gloo, bounded. Until it is waited it is in
    flight (in_flight); dropped unwaited, it is noted (unwaited, and the drop hook)."""

    def __init__(self, work, op):
        super().__init__()
        self._work, self._op, self._waited = work, op, False
        _S["works"][id(self)] = dict(what=_what(op), site=_site(), dropped=False)

    def wait(self, timeout=datetime.timedelta(0)):
        op = self._op
        if "kind" in op and not op["matched"]:
            t0 = time.perf_counter()
            _wait([op["other"]], [op["peer"]], "waits " + _say(op),
                  lambda r: f"{op['n'] - 1} {'receives' if op['kind'] == 'send' else 'sends'} posted with rank "
                            f"{op['me']}", op)
            _match(op, _store())
            _S["spent"] += time.perf_counter() - t0
        try:
            done = self._work.wait(timeout or _bound())
        except Exception as e:  # noqa: BLE001 - gloo gave up: say what this rank waited for
            raise _failed(op, e) from e
        self._waited = True
        _S["works"].pop(id(self), None)
        if op in _S["pending"]:
            _S["pending"].remove(op)
        return done

    def __del__(self):
        rec = _S["works"].pop(id(self), None)
        if self._waited or rec is None:
            return
        rec.update(dropped=True, completed=self._work.is_completed())
        _S["dropped"].append(rec)
        if _S["on_drop"] is not None:   # before gloo may write into its freed tensors (and the process crash)
            _S["on_drop"](rec)


for _name in ("is_completed", "is_success", "exception", "source_rank", "result", "synchronize", "get_future"):
    # everything else a work does is gloo's own
    setattr(_Work, _name, lambda self, *a, _name=_name, **k: getattr(self._work, _name)(*a, **k))


def in_flight() -> list[dict]:
    """This rank's asynchronous collectives and transfers posted and not yet waited, their works still held:
    [{what, site}] (site: where it was posted, innermost frame last)."""
    return [dict(rec) for rec in _S["works"].values()]


def unwaited() -> list[dict]:
    """Those of this scope never waited: in flight still, or dropped ({what, site, dropped, completed}). Every work
    must be waited before its tensors are used or freed: gloo writes into them in the background."""
    return [dict(rec) for rec in _S["dropped"]] + in_flight()


def pending_transfers() -> int:
    """How many transfers this rank has posted whose other side has not been met or waited yet."""
    return len(_S["pending"])


def set_drop_hook(fn) -> None:
    """fn({what, site, completed}) when a work is dropped unwaited: its tensors may be freed while gloo still writes
    into them (the likeliest cause if the process then crashes)."""
    _S["on_drop"] = fn


def _failed(op, e) -> Exception:
    """A collective's or transfer's failure inside gloo, with what this rank waited for; other errors unchanged."""
    if isinstance(e, GlooFailed) or not is_gloo_error(e):
        return e
    _S["broken"] = f"gloo failed: {explain(e)}"
    what = "waited " + _say(op) if "kind" in op else f"waited in {op['line']} over ranks {op['group']}"
    return GlooFailed(f"rank {dist.get_rank()} {what}: {explain(e)}")


_GLOO = ("gloo", "Connection closed by peer", "Connection reset by peer", "Timed out waiting", "pair closure",
         "Pair is not connected", "Broken pipe", "Socket Timeout")


def is_gloo_error(e) -> bool:
    """An error of gloo or of the job's store (a peer gone, a timeout), not of the caller's arguments."""
    return isinstance(e, (GlooFailed, dist.DistError)) or isinstance(e, RuntimeError) and any(
        s in str(e) for s in _GLOO)


def explain(e) -> str:
    """torch's and gloo's errors in words: what happened, and what the code most likely did."""
    text = str(e)
    if isinstance(e, GlooFailed):
        return text
    if "Timed out waiting" in text:
        ms = text.split("Timed out waiting")[1].split("ms")[0].strip()
        secs = f"{float(ms) / 1000:.0f} s" if ms.replace(".", "").isdigit() else "its timeout"
        return (f"gloo gave up after {secs}: the peer never completed its side (its process stopped answering, or "
                f"it dropped the work of what it posted)")
    if "pair closure" in text or "Pair is not connected" in text:
        return ("the connection to a peer was closed by an earlier failure (a timeout or a peer that died): nothing "
                "more can pass over it")
    if "Connection closed by peer" in text or "Connection reset by peer" in text or "Broken pipe" in text:
        return "a peer stopped answering: its process died or exited (its connection closed)"
    if isinstance(e, dist.DistStoreError) or "store" in text.lower() and isinstance(e, dist.DistError):
        return ("the job's key-value store stopped answering: rank 0, which serves it, died or exited (or a peer "
                "never came within its timeout)")
    if "setStorage" in text or "storage of size 0" in text or "out of bounds for storage" in text:
        return ("a tensor was used over a storage of another size (freed or resized): an asynchronous collective or "
                "transfer still wrote into it, or its output was freed before its work was waited — wait() on the "
                "work before using or freeing its tensors")
    return f"{type(e).__name__}: {(text.strip().splitlines() or [''])[0][:300]}"


# ---- waiting, with the deadlock and the missing peer named -------------------------------------------------------

def _state(r):
    key = _key("s", r)
    return json.loads(_store().get(key)) if _store().check([key]) else None


def _unmet(but=None) -> list:
    """[[the other side's key, 'send #3 from 0 to 1'], ...]: this rank's transfers posted whose other side was not
    posted yet when last looked (one not waited may have been met since)."""
    return [[op["other"], _short(op)] for op in _S["pending"] if not op["matched"] and op is not but]


def _wait(keys, ranks, where, last_of, op=None) -> None:
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
        state = dict(state="blocked", where=where, n=_S["n"], waits=[[r, k] for r, k in missing], also=_unmet(op))
        store.set(_key("s", me), json.dumps(state))
        blocked = True
        if store.check([_key("verdict")]):
            raise CollectiveMismatch(store.get(_key("verdict")).decode())
        for r, _ in missing:
            s = _state(r)
            if s is not None and s["state"] == "done":
                how = f"it raised {s['error']}" if s.get("error") else "it finished the check"
                if op is None:
                    raise PeerLeft(f"rank {me} {_strip(where)}, but rank {r} left without it ({how}); its last: "
                                   f"{s['where']}. Every rank must make the same collectives and transfers, in the "
                                   f"same order")
                mine, theirs = ("sends to", "receives from") if op["kind"] == "send" else ("receives from", "sends to")
                raise PeerLeft(f"rank {me} {_strip(where)}, but rank {r} left without it ({how}): rank {me} posts "
                               f"more {mine} rank {r} than rank {r} posts {theirs} it — a step one of them skips, or "
                               f"one transfer more on one side")
        cycle = _deadlock(me)
        if cycle is not None and cycle == seen:
            msg = ("deadlock: every rank here waits for a peer that waits elsewhere — "
                   + "; ".join(f"rank {r} {_strip(s['where'], 'waits at ')}, waiting for rank(s) "
                               f"{[w for w, _ in s['waits']]}" + _also(s) for r, s in sorted(cycle.items())) + ". "
                   + _advice(cycle) + f" (found after {time.monotonic() - start:.2f} s)")
            store.set(_key("verdict"), msg)
            raise CollectiveMismatch(msg)
        seen = cycle
        if time.monotonic() - start > _S["patience"]:
            who = "; ".join(f"rank {r} never reached it (its last: {last_of(r)}; it is not waiting at a watched "
                            f"collective or transfer: still computing, or in an endless loop?)" for r, _ in missing)
            raise CollectiveMismatch(f"rank {me} {_strip(where)}, but {who} within {_S['patience']:.0f} s")
    if blocked:
        store.set(_key("s", me), json.dumps(dict(state="running", where=where, n=_S["n"], waits=[])))


def _strip(where, prefix="waits at "):
    return where if where.startswith("waits ") else prefix + where


def _also(s) -> str:
    also = [what for key, what in s.get("also", []) if not _store().check([key])]
    return f" (its other transfers not met yet: {', '.join(also[:4])}{' …' if len(also) > 4 else ''})" if also else ""


def _advice(cycle) -> str:
    wheres = [s["where"] for s in cycle.values()]
    if all("to send" in w and "to receive" not in w for w in wheres):
        return ("A send completes only when its receive is posted, and none of these ranks posts one: post each "
                "send together with the receive it waits for (one batch_isend_irecv).")
    if all(" to receive " in w or " to send " in w for w in wheres):
        return ("The n-th send from one rank to another meets that rank's n-th receive from it, whatever batch or "
                "call each sits in; here each rank waits for a transfer its peer has not posted: count each rank's "
                "sends and receives with each peer (one skipped, or one more on one side).")
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


# ---- scopes: one check (or step) after another ---------------------------------------------------------------------

def begin_check() -> None:
    """Before a scope (a grading check; a training step), on every rank alike: fresh keys, counters and events."""
    _S["check"] += 1
    _S["seq"].clear(), _S["posted"].clear(), _S["pending"].clear(), _S["works"].clear(), _S["dropped"].clear()
    _S["broken"] = None
    events.clear()
    _S["probe"] = None


def set_probe(fn) -> None:
    """fn(event) is called on every event as it is logged (a check adds what it measures, e.g. gradients so far)."""
    _S["probe"] = fn


def stats() -> dict:
    """The watch's own cost since install: calls watched, and seconds spent in it (its store round trips, and its
    waits for peers, which the collective itself would otherwise have spent in gloo)."""
    return dict(calls=_S["calls"], seconds=_S["spent"])


def end_check(error: str | None, wait: float | None = None, broken: str | None = None) -> dict:
    """After a scope: say I am done (and how), and wait (at most `wait` s, default patience + 5) for every rank to be
    done. Returns {rank: its error or None}, the same on every rank (one not done in time: "never finished the
    check"); unusable() then says whether the process group can serve the next scope. `broken`: a failure of gloo
    this rank met outside the watch."""
    _S["unusable"] = {}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {0: error}
    store, me, P = _store(), dist.get_rank(), dist.get_world_size()
    last = events[-1]["line"] if events else "none"
    store.set(_key("s", me), json.dumps(dict(state="done", error=error, where=last, n=_S["n"], waits=[],
                                             broken=broken or _S["broken"], also=_unmet())))
    deadline = time.monotonic() + (_S["patience"] + 5 if wait is None else wait)
    while True:
        states = {r: _state(r) for r in range(P)}
        if all(s is not None and s["state"] == "done" for s in states.values()):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    errors, dirty = {}, {}
    for r, s in states.items():
        if s is None or s["state"] != "done":
            errors[r] = dirty[r] = "never finished the check"
        else:
            errors[r] = s["error"]
            if s.get("broken"):
                dirty[r] = s["broken"]
    if dirty:   # (a rank that finishes late reads the others' verdict)
        store.set(_key("unusable"), json.dumps(dirty))
    elif store.check([_key("unusable")]):
        dirty = {int(r): why for r, why in json.loads(store.get(_key("unusable"))).items()}
    _S["unusable"] = dirty
    return errors


def unusable() -> dict:
    """{rank: why}: the ranks whose process group the last scope left unusable (gloo failed inside it, a pair of
    ranks closed by a timeout, or a rank never finished the scope): the group must be rebuilt. The same on every
    rank. (A transfer posted that no peer met leaves nothing behind: each scope's transfers carry their own tags.)"""
    return dict(_S["unusable"])
