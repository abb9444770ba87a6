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

import contextlib
import contextvars
import datetime
import inspect
import json
import os
import signal
import sys
import threading
import time
import traceback
import zlib

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "broadcast", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_to_all_single", "all_gather", "reduce_scatter", "all_to_all", "barrier",
               "reduce")
_ORIGINAL: dict[str, object] = {}
_PG_ORIGINAL: dict[str, object] = {}   # ProcessGroup.send / .recv: where every transfer is posted
_S = dict(check=0, seq={}, posted={}, pending=[], n=0, patience=10.0, busy=10.0, events=[], probe=None, broken=None, works={},
          on_drop=None, dropped=[], calls=0, spent=0.0, unusable={}, notes={}, trips=0, cycle=None, waiting=None,
          run=None, slept=0.0, current=None)
_CONTEXT = contextvars.ContextVar("course_collective_context", default=())
_ABSENT = "\x00"  # what compare_set expects and no key holds: a read that returns at once, set or not
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


def install(patience: float = 10.0, busy: float | None = None) -> None:
    """Wrap torch.distributed's collectives (and the names the course's modules bound to them), and the process
    groups' send and recv (every transfer passes there). patience: how long a rank waits for a peer that waits
    elsewhere or never posts; busy (default: patience): for a peer still computing — not at a watched collective —
    e.g. the grader's limit on a check, whose own alarm stops that peer (a slow rank on a busy machine is not
    called lost)."""
    _S["patience"] = float(patience)
    _S["busy"] = float(patience if busy is None else busy)
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
        _check_arguments(name, a)
        t0 = time.perf_counter()
        try:
            rec = _collective(name, a)
        except CollectiveMismatch as e:
            raise _stop(e) from None
        finally:
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
    elif op == "reduce":
        t = a["tensor"]
        red = str(a["op"]).split(".")[-1].lower()
        rec.update(numel=t.numel(), dtype=_dt(t), bytes=_nb(t),
                   line=f"reduce ({red}) of {t.numel():,} {_dt(t)} elements to rank {a.get('dst', a.get('group_dst'))}")
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
    note, at = _S["notes"].pop(gname, None), _at()
    line = rec["line"] + (f" — {note}" if note else "")   # (a strategy's own words: mesh.agree)
    rec.update(line=line, at=at)
    mine = dict(line=line, send=rec.get("send"), recv=rec.get("recv"), rows=rec.get("rows"), seq=seq, at=at)
    key = _key("c", gname, seq)   # one key a collective: each rank appends its line, one read sees them all
    _store().append(key, json.dumps([me, mine]) + "\n")
    where = f"{line} over ranks {ranks} (its collective #{seq + 1} there{', ' + at if at else ''})"
    said = _lines(_wait([(r, key, "line") for r in ranks], where, lambda r: _last_line(gname, seq, r))[key])
    lines = {r: s["line"] for r, s in said.items()}
    if len(set(lines.values())) > 1:
        raise CollectiveMismatch(_differ(ranks, said))
    if rec.get("send") is not None or rec.get("recv") is not None:
        _check_splits(ranks, said, rec)
    return rec


def _lines(value) -> dict:
    """{rank: what it said} of a collective's key (one JSON [rank, entry] a line)."""
    out = {}
    for row in (value or "").splitlines():
        r, x = json.loads(row)
        out[r] = x
    return out


def _last_line(gname, seq, r) -> str:
    said = _lines(_peek(_key("c", gname, seq - 1))) if seq else {}
    return _with_at(said[r]) if r in said else "none yet"


def _with_at(s) -> str:
    return s["line"] + (f" ({s['at']})" if s.get("at") else "")


def _differ(ranks, said) -> str:
    lines = {r: s["line"] for r, s in said.items()}
    kinds = {line.split(" of ")[0] for line in lines.values()}   # the op and its reduction: "all_reduce (sum)"
    sizes = {line.split(" — ")[0] for line in lines.values()}
    words = {line.split(" — ", 1)[1] if " — " in line else "" for line in lines.values()}
    if len(kinds) > 1:
        what = ("different collectives: the ranks make theirs in a different order, or one rank makes one more or "
                "one fewer")
    elif len(words) > 1:
        what = ("the same collective made for different things (the lessons' own words differ): one rank makes one "
                "more or one fewer, or the ranks make them in a different order"
                + (" — of the same size, gloo would have handed each the other's data" if len(sizes) == 1 else ""))
    elif next(iter(kinds)).startswith("all_to_all"):
        what = ("the rows differ in shape or dtype: an all-to-all's ranks may send different numbers of rows, but "
                "every row must have the same shape and dtype on every rank")
    else:
        what = ("the same collective with different sizes (or dtypes): every rank must hand over the same shape "
                "— or one rank is a collective ahead of the others")
    return (f"the ranks of group {ranks} disagree on their collective #{said[ranks[0]]['seq'] + 1} there — "
            + "; ".join(f"rank {r}: {_with_at(said[r])}" for r in ranks) + f" — {what}")


def _check_own_splits(rec) -> None:
    """An all-to-all's splits must describe this rank's own tensors (checked here, before any peer is involved). The
    list form (dist.all_to_all) has no splits of its own: its tensors are the pieces."""
    if "rows" not in rec:
        return
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
        try:
            op = _post(group, kind, tensors[0], peer, tag)
        except CollectiveMismatch as e:
            raise _stop(e) from None
        finally:
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
    _store().set(op["key"], json.dumps(dict(what=what, numel=op["numel"], dtype=op["dtype"], at=_at())))
    _S["current"] = f"posts the {_short(op)} ({what}{', ' + _at() if _at() else ''})"
    theirs = _peek(op["other"])   # (published before looking: of two sides posted at once, one sees the other)
    if theirs is not None:
        _match(op, theirs)
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


def _match(op, theirs) -> None:
    """The other side is posted: the two must agree on the size (gloo aborts a receiver sent more than it has room
    for, and leaves the rest of a larger one unwritten). Of two sides that differ, the one posted second is refused
    before gloo sees it."""
    theirs = json.loads(theirs)
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
            try:
                got = _wait([(op["peer"], op["other"], "set")], "waits " + _say(op),
                            lambda r: f"{op['n'] - 1} {'receives' if op['kind'] == 'send' else 'sends'} posted with "
                                      f"rank {op['me']}", op)
                _match(op, got[op["other"]])
            except CollectiveMismatch as e:
                raise _stop(e) from None
            finally:
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
    v = _peek(_key("s", r))
    return json.loads(v) if v is not None else None


def _peek(key):
    """The value of `key` now, or None if it is not set: one round trip that never waits (compare_set with an
    expected value no key holds returns the value, or that expected value when there is none)."""
    _S["trips"] += 1
    v = _store().compare_set(key, _ABSENT, "")
    return None if v == _ABSENT.encode() else v.decode()


def _read(need) -> tuple[dict, list]:
    """({key: its value}, the needs [(rank, key, kind)] not met): kind "set", the key is set; "line", the rank's line
    is among the key's. One read a key."""
    vals = {k: _peek(k) for k in dict.fromkeys(k for _, k, _ in need)}
    return vals, [n for n in need if not _met(vals[n[1]], n[0], n[2])]


def _met(value, r, kind) -> bool:
    return value is not None and (kind == "set" or f"[{r}, " in value and r in _lines(value))


def _unmet(but=None) -> list:
    """[[the other side's key, 'send #3 from 0 to 1'], ...]: this rank's transfers posted whose other side was not
    posted yet when last looked (one not waited may have been met since)."""
    return [[op["other"], _short(op)] for op in _S["pending"] if not op["matched"] and op is not but]


def _wait(need, where, last_of, op=None) -> dict:
    """Wait until every need [(rank, key, kind)] is met (_read); meanwhile publish what I wait for, and raise as soon
    as the wait cannot end. Returns {key: value} as last read."""
    store, me, start = _store(), dist.get_rank(), time.monotonic()
    nap, blocked, seen, next_look = 0.00005, False, None, start + 0.05
    _S["waiting"] = _S["current"] = where
    try:
        while True:
            # poll (store.wait with a short timeout would log a warning at every expiry): soon, then less often
            vals, missing = _read(need)
            if not missing:
                break
            t0 = time.perf_counter()
            time.sleep(nap)
            _S["slept"] += time.perf_counter() - t0
            # (a peer a few ms behind is met within a ms; one far behind costs a read every 10 ms)
            nap = min(0.01 if time.monotonic() - start > 0.02 else 0.001, nap * 2)
            if time.monotonic() < next_look:
                continue
            next_look = time.monotonic() + 0.2
            _look(store, me, start, where, missing, last_of, op, seen)
            blocked, seen = True, _S["cycle"]
    finally:
        _S["waiting"] = None
    if blocked:
        store.set(_key("s", me), json.dumps(dict(state="running", where=where, n=_S["n"], waits=[])))
    return vals


def _look(store, me, start, where, missing, last_of, op, seen) -> None:
    """A wait's look, every 0.2 s: say what this rank waits for; raise if a peer's verdict, departure, a deadlock or
    the patience says the wait cannot end."""
    state = dict(state="blocked", where=where, n=_S["n"], waits=[list(n) for n in missing], also=_unmet(op))
    store.set(_key("s", me), json.dumps(state))
    v = _peek(_key("verdict"))
    if v is not None:
        raise CollectiveMismatch(v)
    for r, _, _ in missing:
        s = _state(r)
        if s is not None and s["state"] == "done":
            how = s.get("how") or (f"it raised {s['error']}" if s.get("error") else "it finished the check")
            if op is None:
                raise PeerLeft(f"rank {me} {_strip(where)}, but rank {r} left without it ({how}); its last: "
                               f"{s['where']}. Every rank must make the same collectives and transfers, in the "
                               f"same order")
            mine, theirs = ("sends to", "receives from") if op["kind"] == "send" else ("receives from", "sends to")
            raise PeerLeft(f"rank {me} {_strip(where)}, but rank {r} left without it ({how}): rank {me} posts "
                           f"more {mine} rank {r} than rank {r} posts {theirs} it — a step one of them skips, or "
                           f"one transfer more on one side")
    cycle = _S["cycle"] = _deadlock(me)
    if cycle is not None and cycle == seen:
        msg = ("deadlock: every rank here waits for a peer that waits elsewhere — "
               + "; ".join(f"rank {r} {_strip(s['where'], 'waits at ')}, waiting for rank(s) "
                           f"{[w[0] for w in s['waits']]}" + _also(s) for r, s in sorted(cycle.items())) + ". "
               + _advice(cycle) + f" (found after {time.monotonic() - start:.2f} s)")
        # two ranks of the cycle may each find it, one seeing more of it: the first said is every rank's
        raise CollectiveMismatch(store.compare_set(_key("verdict"), "", msg).decode())
    waited, busy = time.monotonic() - start, all(_computing(r) for r, _, _ in missing)
    limit = _S["busy"] if busy else _S["patience"]
    if waited > limit:
        who = "; ".join(f"rank {r} never reached it (its last: {last_of(r)}; " + (
            "it is not waiting at a watched collective or transfer: still computing, or in an endless loop?)"
            if _computing(r) else f"it {_strip(_state(r)['where'])})") for r, _, _ in missing)
        raise _stop(CollectiveMismatch(f"rank {me} {_strip(where)}, but {who} within {limit:.0f} s"))


def _computing(r) -> bool:
    """Rank r is between collectives (running its code, not waiting at a watched one)."""
    s = _state(r)
    return s is None or s["state"] == "running"


def _strip(where, prefix="waits at "):
    return where if where.startswith("waits ") else prefix + where


def _also(s) -> str:
    also = [what for key, what in s.get("also", []) if _peek(key) is None]
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
            if any(_met(_peek(k), w, kind) for w, k, kind in s["waits"]):
                return None  # what it waited for has come: it is moving on
            todo += [w[0] for w in s["waits"]]
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
    if _S["run"] is not None:   # a watched run's verdict is its scope's: the next scope starts with none said
        _S["run"].update(raised=False, printed=False)


def set_probe(fn) -> None:
    """fn(event) is called on every event as it is logged (a check adds what it measures, e.g. gradients so far)."""
    _S["probe"] = fn


def stats() -> dict:
    """The watch's own cost since install: calls watched, seconds spent in it (its store round trips, and its waits
    for peers, which the collective itself would otherwise have spent in gloo), of them asleep waiting for a peer,
    and store round trips."""
    return dict(calls=_S["calls"], seconds=_S["spent"], waiting=_S["slept"], round_trips=_S["trips"])


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
            errors[r] = s["error"] if "error" in s else s.get("how")   # (a rank that left the run: how it left)
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


# ---- a run under --watch: what each collective belongs to, the cost, and each rank's pending collective ----------
#
# `torchrun ... train.py --watch` (or any lesson's run) installs the watch for the whole run (start): every
# collective and transfer is checked as above, its line names what it belongs to — the strategy's own words
# (mesh.agree: "gathers unit 2 (layers.1) for forward") and the labels the composition and demos set around it
# (context: "step 3 › micro-batch 1") — and the first rank that finds a mismatch, a deadlock or a rank that never
# came makes it every rank's verdict: each rank prints where it was (its pending collective, its Python stack) and
# the run ends. `kill -USR1 <a rank's pid>` prints the same at any moment, the run going on. summary() says what it
# cost.

def context(label: str):
    """Inside, each collective and transfer this rank makes belongs to `label` too (nested labels join: "step 3 ›
    micro-batch 1"). Costs next to nothing: set it around every step."""
    return _labelled(label)


@contextlib.contextmanager
def _labelled(label):
    token = _CONTEXT.set(_CONTEXT.get() + (label,))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def _at() -> str:
    return " › ".join(_CONTEXT.get())


def add_flags(parser) -> None:
    """--watch and --patience, on a lesson's (or train.py's) command line."""
    parser.add_argument("--watch", action="store_true",
                        help="check every collective and transfer against the other ranks' before it runs (through "
                             "the job's store): a mismatch, a deadlock or a rank that stops coming ends the run with "
                             "each rank's pending collective and stack; kill -USR1 a rank's pid prints them (slower: "
                             "never for timing)")
    parser.add_argument("--patience", type=float, default=float(os.environ.get("COURSE_WATCH_PATIENCE", "30")),
                        help="with --watch: seconds a rank waits for a peer that does not come before it names it "
                             "(COURSE_WATCH_PATIENCE)")


def start(patience: float = 30.0) -> None:
    """Watch the whole run (every rank, before its first collective): install(patience), one scope, the verdict
    shared, kill -USR1 answered, and a thread that prints where this rank is when another rank stopped the run."""
    install(patience)
    begin_check()
    _S["run"] = dict(t0=time.perf_counter(), printed=False)
    answer_usr1()
    if _G["thread"] is None:
        _start_watchdog()


def watching() -> bool:
    return _S["run"] is not None


def _stop(e: Exception) -> Exception:
    """In a run, the error this rank found becomes every rank's verdict (the first one said), and the rank says where
    it stopped."""
    run = _S["run"]
    if run is not None and dist.is_initialized() and not run.get("raised"):
        run["raised"] = True
        said = _store().compare_set(_key("verdict"), "", str(e)).decode()
        _S["trips"] += 1
        _say_where(sys._getframe(2), "stops", at=_S["current"])
        if said != str(e):   # a peer found it first (two ranks that see a peer leave at once): its words
            return type(e)(said)
    return e


def answer_usr1() -> None:
    """kill -USR1 <pid> prints where this rank is (pending()) and its Python stack, the run going on: --watch's
    words, or without it the guard's (the collective it announced last). Every lesson's run answers it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda signum, frame: _say_where(frame, "kill -USR1"))


def pending() -> str:
    """What this rank waits for now, or its last collective or transfer (with what it belongs to)."""
    if _S["run"] is None and not _ORIGINAL:   # no watch: what the guard knows
        state = _G["state"]
        where = {"gate": "waits at the gate before the optimizer step (its peers' records of the step)",
                 "slow": "waits for its peers' lines at", "fast": "last announced", "after": "last announced"}
        return (f"{where[state[0]]}{' ' + state[3] if len(state) > 3 else ''} (step {_G['epoch'] + 1}; the "
                f"collective itself may be running: --watch says)" if state[0] in where else
                f"not at an announced collective (step {_G['epoch'] + 1}; --watch sees every collective)")
    if _S["waiting"]:
        return f"waits at {_S['waiting']}" if not _S["waiting"].startswith("waits ") else _S["waiting"]
    flying = in_flight()
    if flying:
        return "posted and not waited yet: " + "; ".join(w["what"] for w in flying[:3])
    last = events[-1] if events else None
    where = f" ({_at()})" if _at() else ""
    return (f"not at a watched collective{where}; its last: {last['line']} over ranks {last['group']}"
            + (f" ({last['at']})" if last.get("at") else "") if last else f"no collective yet{where}")


def _say_where(frame, why, at=None) -> None:
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no Python frame)\n"
    print(f"[rank {dist.get_rank() if dist.is_initialized() else os.environ.get('RANK', '0')}] {why}: "
          f"{_strip(at) if at else pending()}. Its Python stack, innermost last:\n{stack}", file=sys.stderr, end="",
          flush=True)


def report(seconds: float | None = None, of: str = "the run") -> None:
    """Print summary() once, on every rank (a run under --watch; nothing otherwise)."""
    if _S["run"] is None or _S["run"].get("reported"):
        return
    _S["run"]["reported"] = True
    sys.stdout.write(f"[rank {dist.get_rank()}] {summary(seconds, of)}\n")   # (one write: ranks share a terminal)
    sys.stdout.flush()


def summary(seconds: float | None = None, of: str = "the run") -> str:
    """One line: what the watch cost this rank — calls watched, store round trips and milliseconds each (its own
    work: the round trips and the bookkeeping, not the time it waited for a slower peer, which the collective would
    have waited in gloo), and their share of `seconds` (default: since start)."""
    calls, trips, own = _S["calls"], _S["trips"], _S["spent"] - _S["slept"]
    total = seconds if seconds is not None else time.perf_counter() - (_S["run"] or dict(t0=0))["t0"]
    each = f"{trips / calls:.1f} store round trips and {own / calls * 1e3:.2f} ms each" if calls else "nothing"
    return (f"--watch: {calls} collectives and transfers watched, {each} on average: {own:.3f} s, {own / total:.1%} "
            f"of {of} ({total:.2f} s; it also waited {_S['slept']:.2f} s for slower peers)")


# ---- the guard: what every run checks, a few store round trips a step (mesh.agree, mesh.agree_step) ---------------
#
# The watch above says every collective through the store before it runs: exact, and a few store round trips each.
# Every run keeps a cheaper promise by default: a collective that differs across ranks never applies a wrong update,
# and ends in one clear error on every rank.
#   - Before each collective a strategy announces (announce: fsdp.py's gathers and reductions, hsdp.py's all-reduce),
#     the rank folds its line into its record of the step (per group: a count and a checksum) and compares it with
#     the line at the same place of the last step, which every rank agreed on. The same line: nothing more, no store
#     traffic. Another line (or no step agreed yet): it is agreed on its own through the store before it runs, as
#     the watch would, so a collective of another size never reaches gloo (which aborts a process sent more bytes
#     than it expects). A rank whose line differs from the last step's and its peers' cannot pass.
#   - Before the optimizer applies the step (settle), every rank says its record (an append and a count) and reads
#     its peers': records that differ, or a peer still inside a collective this rank never makes, raise on every
#     rank — the update is not applied. Then this step's lines are the next step's to compare with.
#   - A rank that entered a collective its peers never make (it followed the last step, a peer did not) waits inside
#     gloo, where it cannot say anything: after STALL seconds without progress a watchdog thread publishes where it
#     is (its last lines per group), from which the peer waiting in the store names the mismatch; the watchdog then
#     reads that verdict, prints it and ends the process (its collective would only end at the timeout).
# Keys: course/guard/<step>/<group>/<k> (a collective agreed on its own: one line per rank, appended), .../gate (the
# step's records; /n counts the ranks in, /done is "ok" once all are, or a verdict), course/guard/at/<rank> (where a
# waiting or stalled rank is), course/guard/verdict/<step>.

STALL = 1.0      # seconds without progress after which a rank's watchdog says where it is
_G = dict(epoch=0, log=[], history=None, count={}, crc={}, known={}, said={}, state=("idle",), progress=0,
          tainted=False, handled=None, thread=None, groups={}, mine=[], gates=0, slow=0, fast=0, seconds=0.0,
          gate=None, waiter=None)


def _info(group) -> dict:
    """What the guard needs of a group, looked up once: is it checked (more than one rank, gloo or NCCL), its name,
    ranks and this rank."""
    g = _G["groups"].get(id(group))
    if g is None or g["pg"] is not group:
        live = dist.get_world_size(group) > 1 and dist.get_backend(group) in ("gloo", "nccl")
        g = dict(pg=group, live=live, name=group.group_name if live else None, me=dist.get_rank(),
                 ranks=dist.get_process_group_ranks(group) if live else [])
        _G["groups"][id(group)] = g
    return g


def announce(group, what: str, fix: str = "", patience: float = 120.0) -> None:
    """Before a collective on `group`: this rank is about to do `what` (one line). Raises CollectiveMismatch on every
    rank of the group when their lines differ, or a peer cannot come (mesh.agree)."""
    group = group if group is not None else dist.group.WORLD
    g = _info(group)
    if not g["live"]:
        return
    name = g["name"]
    if _ORIGINAL:   # the watch checks every collective itself: the line names the next one on the group
        _S["notes"][name] = what
        return
    t0 = time.perf_counter()
    k, i = _G["count"].get(name, 0), len(_G["log"])
    _G["count"][name] = k + 1
    _G["crc"][name] = zlib.crc32(what.encode(), _G["crc"].get(name, 0))
    _G["log"].append((name, what))
    _G["known"][name] = g["ranks"]
    _G["progress"] += 1
    h = _G["history"]
    if h is not None and i < len(h) and h[i] == (name, what):   # as in the last step, which every rank agreed on
        _G["state"] = ("fast", name, k, what)
        _G["fast"] += 1
        if _G["thread"] is None:
            _start_watchdog()
        return
    _G["slow"] += 1
    try:
        _agree_one(g, k, what, fix, patience)
    finally:
        _G["seconds"] += time.perf_counter() - t0


def _agree_one(g, k, what, fix, patience) -> None:
    """One collective agreed through the store before it runs: every member's line at the same place."""
    name, ranks, me, e = g["name"], g["ranks"], g["me"], _G["epoch"]
    _G["state"] = ("slow", name, k, what)
    _publish()
    before = _G["said"].get(name, {})
    if _G["thread"] is None:
        _start_watchdog()

    def look(said, missing, waited):
        return _look_slow(g, k, what, missing, waited, patience, before, fix)
    said = _gather(f"course/guard/{e}/{name}/{k}", me, what, ranks, look)
    if me == min(ranks):
        _G["mine"].append(f"course/guard/{e}/{name}/{k}")
    _G["said"][name] = said
    _G["state"] = ("after", name, k, what)
    _G["progress"] += 1
    if len(set(said.values())) > 1:
        _fail(name, k, _differ_line(ranks, said, fix))


def _differ_line(ranks, said, fix) -> str:
    return (f"the ranks of group {ranks} disagree on their next collective: "
            + "; ".join(f"rank {r} {said[r]}" for r in ranks) + f". {fix}".rstrip())


def _gather(key, me, mine, members, look) -> dict:
    """Append my entry to `key` and wait until every member's is there ({rank: entry}); every 0.2 s `look` at who
    is missing (it may raise, or answer for a member: {rank: entry})."""
    _store().append(key, json.dumps([me, mine]) + "\n")
    start = time.monotonic()
    nap, next_look, extra = 5e-5, start + 0.05, {}
    while True:
        v = _peek(key)
        said = dict(extra)
        for row in (v or "").splitlines():
            r, x = json.loads(row)
            said[r] = x
        missing = [r for r in members if r not in said]
        if not missing:
            return said
        time.sleep(nap)
        nap = min(nap * 2, 0.005)
        now = time.monotonic()
        if now >= next_look:
            next_look = now + 0.2
            extra.update(look(said, missing, now - start) or {})


def _publish(at=None) -> None:
    """Where this rank is (what it waits for, its last lines per group this step), for a peer that waits for it."""
    state, log = _G["state"], list(_G["log"])
    tails = {}
    for n, line in log:
        tails.setdefault(n, []).append(line)
    _store().set(f"course/guard/at/{dist.get_rank()}", json.dumps(dict(
        epoch=_G["epoch"], state=state[0], exit=_G.get("exit"), at=at or _main_at(),
        name=state[1] if len(state) > 1 else None,
        k=state[2] if len(state) > 2 else None, line=state[3] if len(state) > 3 else None,
        count=dict(_G["count"]), ranks=dict(_G["known"]),
        tails={n: [len(lines) - len(lines[-8:]), lines[-8:]] for n, lines in tails.items()})))


def _main_at() -> str | None:
    """file:line in function of the main thread's innermost frame outside torch (where a stalled rank is)."""
    f, torch_dir = sys._current_frames().get(threading.main_thread().ident), os.path.dirname(torch.__file__)
    while f is not None and (f.f_code.co_filename.startswith(torch_dir) or f.f_code.co_filename == __file__):
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}" if f is not None else None


def _position(r):
    v = _peek(f"course/guard/at/{r}")
    pos = json.loads(v) if v else None
    return pos if pos is not None and pos["epoch"] == _G["epoch"] else None


def _stalled_at(q, pos=None) -> str:
    pos = pos or _position(q)
    return f"; it waits at {pos['at']}" if pos and pos.get("at") else ""


def _line_at(pos, name, k):
    """A peer's line number k on group `name` this step, from its published tail (None: not there)."""
    first, lines = pos["tails"].get(name, [0, []])
    return lines[k - first] if first <= k < first + len(lines) else None


def _look_slow(g, k, what, missing, waited, patience, before, fix):
    """A collective agreed on its own, and `missing` have not said theirs: where are they?"""
    name, ranks, me = g["name"], g["ranks"], g["me"]
    _verdict_raised()
    answered = {}
    for q in missing:
        pos = _position(q)
        if pos is None:
            continue
        theirs = _line_at(pos, name, k)
        if pos["state"] == "left" and pos["count"].get(name, 0) <= k:
            _conclude(f"rank {me} {what} (its collective #{k + 1} over ranks {ranks} in step {_G['epoch'] + 1}), "
                      f"but rank {q} left the run (exit code {pos['exit']}) without it.")
        if pos["state"] == "gate" and pos["count"].get(name, 0) <= k:
            _conclude(f"rank {me} {what} (its collective #{k + 1} over ranks {ranks} in step {_G['epoch'] + 1}), "
                      f"but rank {q} reached the optimizer step after {pos['count'].get(name, 0)} collectives "
                      f"there: a collective some ranks make and others skip. {fix}")
        elif theirs is not None:   # it passed this place without asking: its line is the last step's
            if theirs != what:
                _conclude(_differ_line(ranks, {**{r: what for r in ranks}, q: theirs}, fix)
                          + f" (collective #{k + 1} there in step {_G['epoch'] + 1})")
            answered[q] = theirs
        elif pos["state"] == "slow" and (pos["name"], pos["k"]) != (name, k) \
                and me in pos["ranks"].get(pos["name"], []) and _G["count"].get(pos["name"], 0) <= pos["k"]:
            _conclude(f"rank {me} {what} (collective #{k + 1} over ranks {ranks}), while rank {q} {pos['line']} "
                      f"(collective #{pos['k'] + 1} over ranks {pos['ranks'][pos['name']]}) and waits for rank "
                      f"{me} there: the ranks make their collectives in a different order. {fix}")
    if waited > patience:
        agreed = [line for n, line in _G["log"][:-1] if n == name]   # (every member made these, as this rank did)
        raise _failed_here(name, k, f"rank {me} {what}, but " + "; ".join(
            f"rank {q} never reached its next collective over ranks {ranks} (its last: "
            f"{before.get(q) or (agreed[-1] if agreed else 'none yet')}{_stalled_at(q)})" for q in missing)
            + f" within {patience:.0f} s. " + (fix or "Every rank must make the same collectives in the same order."))
    return answered


def settle(fix: str = "", groups=(), patience: float = 120.0) -> None:
    """Before an optimizer applies a step: every rank's record of the step (per group: how many collectives, and a
    checksum of their lines) agreed with its peers' at one gate (_gate); raises CollectiveMismatch on every rank when
    they differ, before anything is applied (mesh.agree_step). `groups`: the groups the step reduces over (their
    ranks take part even where this rank announced nothing on them)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or _ORIGINAL:
        return
    t0 = time.perf_counter()
    me, e = dist.get_rank(), _G["epoch"]
    passed = set()
    for group in groups:
        g = _info(group if group is not None else dist.group.WORLD)
        if g["live"]:
            _G["known"].setdefault(g["name"], g["ranks"])
            passed.add(g["name"])
    # the groups of this step: those it reduces over and those it made collectives on (a process that builds many
    # meshes in turn knows every group it ever used; the ones idle this step have nothing to compare)
    known = {n: ranks for n, ranks in _G["known"].items() if n in passed or _G["count"].get(n, 0)}
    if not known:
        return
    mine = {n: [_G["count"].get(n, 0), _G["crc"].get(n, 0), ranks] for n, ranks in known.items()}
    _G["state"] = ("gate",)
    _G["progress"] += 1
    if _G["thread"] is None:
        _start_watchdog()
    # one gate per group, in one order on every rank (by name, like locks): the gate's ranks are exactly the group's,
    # whatever other groups each member is in (HSDP: rank 0 meets 1 on dp_shard and 2 on dp_replicate)
    tainted, gates = False, []
    for n in sorted(known):
        c, x, ranks = mine[n]
        said = _gate(f"course/guard/{e}/gate/{n}", me, dict(g=[c, x], t=_G["tainted"]), ranks, patience, fix)
        if me == min(ranks):
            gates += [f"course/guard/{e}/gate/{n}{x}" for x in ("", "/n", "/done")]
        tainted |= any(said[q]["t"] for q in ranks)
        if any(said[q]["g"][:2] != [c, x] for q in ranks):
            _fail(None, None, _records_differ(e, [n], said, fix))
    _G["history"] = None if tainted else list(_G["log"])
    # a gate's keys go two steps later: every member has left it by then (a member may still read this step's)
    older, last = _G.get("gate_keys", ([], []))
    old = _G["mine"] + older
    _G.update(epoch=e + 1, log=[], count={}, crc={}, said={}, state=("idle",), tainted=False, mine=[],
              gate_keys=(last, gates))
    _G["progress"] += 1
    _G["gates"] += 1
    for key in old:
        _store().delete_key(key)
        _S["trips"] += 1
    _G["seconds"] += time.perf_counter() - t0


def _gate(key, me, mine, part, patience, fix) -> dict:
    """The step's gate: append my record to `key`, count myself in; the last rank in opens the gate, the others
    block in the store until it does (no polling: a waiting rank leaves the cores to the ranks still computing),
    while the watchdog thread looks at who is missing (_gate_look) and may close the gate with a verdict instead.
    Returns {rank: record}; raises the verdict."""
    store = _store()
    store.append(key, json.dumps([me, mine]) + "\n")
    done = key + "/done"
    _S["trips"] += 2
    if store.add(key + "/n", 1) == len(part):
        v = store.compare_set(done, "", "ok").decode()   # (a verdict the watchdog of a rank gave up with stands)
        _S["trips"] += 1
    else:
        if _G["waiter"] is None or _G["waiter"][0] is not store:   # a client of its own: the watchdog uses the
            _G["waiter"] = (store, store.clone())                     # store while this one blocks
        _G["gate"] = dict(key=key, done=done, part=part, t=time.monotonic(), patience=patience, fix=fix,
                          published=False)
        try:
            v = _G["waiter"][1].get(done).decode()
        finally:
            _G["gate"] = None
        _S["trips"] += 1
    if v != "ok":
        raise _failed_here(None, None, v)
    _S["trips"] += 1
    return {r: x for r, x in (json.loads(row) for row in store.get(key).decode().splitlines())}


def _gate_look() -> None:
    """The watchdog's look while the main thread waits at the gate (after 0.2 s): say where this rank is, once; a
    verdict (a peer gone, a peer inside a collective this rank never makes, the patience spent) closes the gate."""
    g = _G["gate"]
    if g is None or time.monotonic() - g["t"] < 0.2:
        return
    if not g["published"]:
        _publish()
        g["published"] = True
    said = {json.loads(row)[0] for row in (_peek(g["key"]) or "").splitlines()}
    missing = [r for r in g["part"] if r not in said]
    v = _gate_verdict(missing, time.monotonic() - g["t"], g["patience"], g["fix"]) if missing else None
    if v is not None:
        _store().compare_set(g["done"], "", v)
        _S["trips"] += 1


def _gate_verdict(missing, waited, patience, fix) -> str | None:
    """This rank reached the optimizer step; `missing` have not: where are they? The verdict, or None (wait on)."""
    me, e = dist.get_rank(), _G["epoch"]
    shared = f"course/guard/verdict/{e}"
    v = _peek(shared)
    if v is not None:
        return v
    for q in missing:
        pos = _position(q)
        msg = None
        if pos is not None and pos["state"] == "left":
            msg = (f"rank {me} reached the optimizer step of step {e + 1}, but rank {q} left the run (exit code "
                   f"{pos['exit']}) before it. No update was applied.")
        elif pos is not None and pos["state"] in ("fast", "slow", "after") and pos["name"] is not None:
            n, k = pos["name"], pos["k"]
            if me in pos["ranks"].get(n, []) and _G["count"].get(n, 0) <= k:
                msg = (f"rank {q} {pos['line']} (its collective #{k + 1} over ranks {pos['ranks'][n]} in step {e + 1})"
                       f", but rank {me} reached the optimizer step after {_G['count'].get(n, 0)} collectives there: "
                       f"a collective some ranks make and others skip. No update was applied. {fix}")
        if msg is not None:   # the first verdict said is every rank's
            _S["trips"] += 1
            return _store().compare_set(shared, "", msg.rstrip()).decode()
    if waited > patience:
        lasts = {q: _position(q) for q in missing}
        return (f"rank {me} reached the optimizer step of step {e + 1}, but " + "; ".join(
            f"rank {q} did not within {patience:.0f} s (its last collective: "
            + (f"{p['line']} over ranks {p['ranks'][p['name']]}" if p and p.get("line") else "none this step")
            + f"{_stalled_at(q, p)})"
            for q, p in lasts.items()) + ". Every rank must make the same collectives in the same order. "
            + f"{fix} {WATCH_HINT}")
    return None


def _records_differ(e, bad, said, fix) -> str:
    """Every rank of the groups whose records differ says its lines of the step; the first place they differ."""
    me = dist.get_rank()
    key = f"course/guard/{e}/logs/" + "+".join(bad)
    mine = {n: [line for m, line in _G["log"] if m == n] for n in bad}
    members = sorted({r for n in bad for r in _G["known"][n]})
    logs = _gather(key, me, mine, members, lambda said, missing, waited: None)
    out = []
    for n in bad:
        ranks = _G["known"][n]
        lines = {r: logs[r].get(n, []) for r in ranks}
        k = next((i for i in range(max(map(len, lines.values())) + 1)
                  if len({tuple(v[i:i + 1]) for v in lines.values()}) > 1), 0)
        out.append(f"in step {e + 1} the ranks of group {ranks} made different collectives; the first that differs "
                   f"is #{k + 1} there: " + "; ".join(
                       f"rank {r} {v[k]}" if k < len(v) else f"rank {r} none (it made {len(v)})"
                       for r, v in lines.items()))
    return "; and ".join(out) + f". No update was applied. {fix} {WATCH_HINT}"


def _conclude(msg: str):
    """A verdict only this wait can reach: the first one said is every rank's (peers read it), raised here."""
    v = _store().compare_set(f"course/guard/verdict/{_G['epoch']}", "", msg.rstrip()).decode()
    _S["trips"] += 1
    raise _failed_here(None, None, v)


def _verdict_raised():
    v = _peek(f"course/guard/verdict/{_G['epoch']}")
    if v is not None:
        raise _failed_here(None, None, v)


def _failed_here(name, k, msg) -> CollectiveMismatch:
    """This rank leaves with `msg`, which its watchdog will not act on again. Its record of the step is no longer one
    every rank agreed on, so the next step is agreed collective by collective. `name`: a collective of that group,
    on which every member raised alike (their records stay alike); None: the step is given up — the next starts
    afresh."""
    _G["handled"] = msg
    _G["tainted"] = True
    _G["state"] = ("idle",)
    _G["progress"] += 1
    if name is not None:
        _G["crc"][name] = zlib.crc32(f"failed at {k}".encode())
    else:
        _G.update(epoch=_G["epoch"] + 1, log=[], count={}, crc={}, said={}, mine=[])
    return CollectiveMismatch(msg)


def _fail(name, k, msg):
    raise _failed_here(name, k, msg)


WATCH_HINT = "(torchrun ... --watch stops at the first collective that differs, before it runs)"


def verdict() -> str | None:
    """The verdict a rank reached on this step (the guard's, or the watch's in a run under --watch), for a rank whose
    collective failed because the rank that said it left: None if none, or the store is gone."""
    try:
        if not dist.is_initialized():
            return None
        return _peek(_key("verdict") if _S["run"] is not None else f"course/guard/verdict/{_G['epoch']}")
    except Exception:  # noqa: BLE001 - the store went with its rank
        return None


def _start_watchdog() -> None:
    _G["thread"] = threading.Thread(target=_watchdog, name="collective-guard", daemon=True)
    _G["thread"].start()


def _watchdog() -> None:
    """While the main thread makes no progress: after STALL s, say where it is (once), and if a peer reached a verdict
    on this step, print it and end the process (its collective would end only at the timeout)."""
    seen, since, published = -1, time.monotonic(), -1
    while True:
        time.sleep(0.25)
        try:
            if _S["run"] is not None:
                _run_verdict()
                continue
            if _G["gate"] is not None:
                _gate_look()
                continue
            p, state = _G["progress"], _G["state"][0]
            now = time.monotonic()
            if p != seen:
                seen, since = p, now
                continue
            if now - since < STALL or state in ("slow", "gate") or not dist.is_initialized():
                continue
            if published != p:
                _G["stalled_at"] = _main_at()
                _publish()
                published = p
            v = _peek(f"course/guard/verdict/{_G['epoch']}")
            if v is not None and v != _G["handled"]:
                print(f"[rank {dist.get_rank()}] {v}", file=sys.stderr, flush=True)
                os._exit(1)
        except Exception:  # noqa: BLE001 - the process group or its store is gone: nothing to watch
            continue


def _run_verdict() -> None:
    """A watched run another rank stopped: print where this rank is (once); a rank not waiting at a watched collective
    cannot raise by itself (it computes, loops, or waits in gloo): it ends here."""
    if not dist.is_initialized() or _S["run"]["printed"]:
        return
    v = _peek(_key("verdict"))
    if v is None or _S["run"].get("raised") or _S["waiting"]:   # (a rank in a watched wait raises it itself)
        return
    _S["run"]["printed"] = True
    _say_where(sys._current_frames().get(threading.main_thread().ident), "the run stops")
    time.sleep(1.0)
    if not _S["waiting"] and not _S["run"].get("raised"):
        print(f"[rank {dist.get_rank()}] {v}", file=sys.stderr, flush=True)
        os._exit(1)


def leave(code: int) -> None:
    """This rank's process ends (exit code `code`) while its process group lives: say so where a peer waiting for it
    looks (the guard's position; a watched run's state), so that it names the rank that left instead of waiting."""
    try:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        if _S["run"] is not None:
            _store().set(_key("s", dist.get_rank()), json.dumps(dict(
                state="done", how=f"it left the run, exit code {code}", where=pending(), n=_S["n"], waits=[])))
        _G.update(state=("left",), exit=code)
        _publish(at=_G.get("stalled_at"))
    except Exception:  # noqa: BLE001 - the group's store is gone: nobody is waiting
        pass


def guard_stats() -> dict:
    """What the guard did since the process started: collectives announced (fast: as in the last step, slow:
    agreed on their own), steps settled, store round trips, seconds."""
    return dict(fast=_G["fast"], slow=_G["slow"], gates=_G["gates"], round_trips=_S["trips"],
                seconds=_G["seconds"])


def mark_unusable(why: str) -> None:
    """A check that found this rank's transfers left posted and never completed (their works dropped): the group is
    not to be reused — end_check reports it broken, and the grader starts a fresh group for the next job."""
    _S["broken"] = why


def _check_arguments(name, a) -> None:
    """A call whose arguments sit in the wrong places, said before any peer is involved: a process group handed over
    where torch expects the reduction (dist.all_reduce(t, group) — the second positional argument is `op`)."""
    if "op" in a and isinstance(a["op"], dist.ProcessGroup):
        raise TypeError(f"dist.{name}(tensor, group): a process group passed where dist.{name} takes the reduction "
                        f"`op` (its second positional argument) — pass the group by name: dist.{name}(tensor, "
                        f"group=group)")
