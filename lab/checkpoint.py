"""Checkpoint files for train.py: saved on any layout, loaded on any other, never half-written, never run.

What is in a checkpoint is fsdp.py's (section 7, "pieces"): every rank owns pieces of the model state, each
with its place in the WHOLE tensor, and a loading rank copies from every saved piece the elements that overlap
its own (fsdp.load_places). This module is the file format around that algorithm, and its safety:

    DIR/step_00000006/           meta.json (written last) and one file per rank that owned pieces: rank0.pt, ...
    DIR/step_00000006.partial/   a checkpoint being written: never read, replaced by the next save

  atomic      a save writes under the .partial name, flushes every file to the disk, then rank 0 writes
              meta.json and renames the directory — one rename, so a crash at any moment leaves every earlier
              checkpoint as it was, and never a half one under a complete name
  integrity   meta.json records each file's size and sha256 and every piece's place; before any collective,
              every rank reads the checkpoint alone and finds the same problems (checkpoint_problems)
  safety      every file is read with torch.load(weights_only=True): tensors only, no code runs
  export      the whole model as ONE plain state dict {name: tensor}, written by rank 0 from the pieces every
              rank sends it, parameter by parameter; init_from starts any layout from such a file
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil

import torch
import torch.distributed as dist

import fsdp

STEP_DIR = "step_{:08d}"


# ---- which checkpoints are complete, and whether one may be loaded ---------------------------------------

def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint directly under root, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("step_") and name[5:].isdigit() and os.path.isfile(os.path.join(path, "meta.json")):
            out.append((int(name[5:]), path))
    return sorted(out)


def resume_path(resume: str | None, save: str | None) -> str | None:
    """The checkpoint --resume names: auto -> the newest under --save (None: none yet, a fresh start);
    a step directory; or a directory of them -> its newest."""
    if resume is None:
        return None
    root = save if resume == "auto" else resume
    if root and os.path.isfile(os.path.join(root, "meta.json")):
        return root
    found = complete_checkpoints(root) if root else []
    return found[-1][1] if found else None


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_problems(path: str, last_step: int, shapes: dict) -> list[str]:
    """Everything that forbids loading the checkpoint at `path` into a run that stops at `last_step` and whose
    model has {name: shape} `shapes`, found by reading it alone — so every rank finds the same, before any
    collective: meta.json unreadable; nothing left to train; another model (names or shapes differ); a rank
    file missing, truncated, altered (size or sha256 differ from what meta.json recorded) or holding anything
    but tensors (read with weights_only=True: no code runs)."""
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        step, files, saved_shapes = int(meta["step"]), meta["files"], meta["params"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{meta_path} cannot be read as a checkpoint's meta.json ({e}): resume another checkpoint"]
    problems = []
    if step >= last_step:
        problems.append(f"{path} already holds step {step}, and this run stops at step {last_step}: nothing is left "
                        f"to train; raise --steps or resume an earlier checkpoint")
    if saved_shapes != shapes:
        differ = sorted(n for n in set(saved_shapes) | set(shapes) if saved_shapes.get(n) != shapes.get(n))
        problems.append(f"{meta_path} was written for another model: {len(differ)} parameters differ in name or "
                        f"shape (first {differ[0]}: saved {saved_shapes.get(differ[0])}, this run's "
                        f"{shapes.get(differ[0])}); resume with its --model/--layers/--experts")
    for name, info in sorted(files.items()):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            problems.append(f"{f} is missing: this checkpoint is incomplete; resume an earlier one")
        elif os.path.getsize(f) != info["bytes"]:
            problems.append(f"{f} holds {os.path.getsize(f)} bytes, meta.json recorded {info['bytes']}: it was "
                            f"truncated or altered; resume an earlier checkpoint")
        elif sha256(f) != info["sha256"]:
            problems.append(f"{f} does not match the sha256 meta.json recorded: it was altered after it was written; "
                            f"resume an earlier checkpoint")
        else:
            problems += loadable(f)
    return problems


def loadable(f: str) -> list[str]:
    """[] if `f` loads with weights_only=True (tensors only), else the one problem saying why not."""
    try:  # memory-mapped: reads the file's index, not its tensors
        torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - whatever the unpickler refuses, it is refused here, on every rank
        return [f"{f} cannot be read safely ({type(e).__name__}: {str(e).splitlines()[0][:200]}): it holds more than "
                f"tensors, and weights_only loading refuses to run code from a file"]
    return []


def state_dict_problems(path: str, shapes: dict) -> list[str]:
    """What forbids starting from the plain state dict at `path` (--init-from): missing, not loadable with
    weights_only=True, or not the names and shapes `shapes` of this model."""
    if not os.path.isfile(path):
        return [f"--init-from {path!r} does not exist: give a state dict file (--export writes one)"]
    bad = loadable(path)
    if bad:
        return bad
    sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    got = {k: list(v.shape) for k, v in sd.items()} if isinstance(sd, dict) else {}
    if got != shapes:
        differ = sorted(n for n in set(got) | set(shapes) if got.get(n) != shapes.get(n))
        return [f"--init-from {path!r} is not a state dict of this model: {len(differ)} names or shapes differ "
                f"(first {differ[0]}: file {got.get(differ[0])}, model {shapes.get(differ[0])})"]
    return []


# ---- saving and loading a training state: every piece with its place ----------------------------------
#
# opt is fsdp's ZeroOptimizer (it owns the pieces); where(name) -> (full shape, narrow) says where the
# parameter this rank holds sits in the whole model's (train.Trainer.where: a tp slice, my experts, or all).

def owned_places(opt, where):
    """This rank's pieces [(unit, piece, place)] that it writes — a piece several ranks hold (data-parallel
    replicas, tp ranks sharing a kv head) is written by the first of them — and every rank's places."""
    mine = fsdp.places(opt, where)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [p for _, _, p in mine])  # metadata only: names and ranges
    first = {}
    for r, ps in enumerate(every):
        for p in ps:
            first.setdefault(p, r)
    return [(k, j, p) for k, j, p in mine if first[p] == dist.get_rank()], every


def save(opt, where, root: str, step: int, *, layout: dict, shapes: dict, keep: int = 0) -> tuple[str, int]:
    """Write checkpoint `step` under root atomically: every rank its pieces (with their places and the
    optimizer state) into root/step_N.partial, flushed; rank 0 then meta.json (sizes and sha256 of every
    file, the places of every piece, `layout` and the model's `shapes`) and renames the directory to
    root/step_N. Keeps the newest `keep` (0: all). Returns root/step_N and the bytes this rank wrote."""
    rank, world = dist.get_rank(), dist.get_world_size()
    final = os.path.join(root, STEP_DIR.format(step))
    partial = final + ".partial"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in [n for n in os.listdir(root) if n.startswith("step_") and n.endswith(".partial")]:
            shutil.rmtree(os.path.join(root, stale))  # what a save that died left behind
        os.makedirs(partial)
    dist.barrier()
    owned, _ = owned_places(opt, where)
    name = f"rank{rank}.pt"
    pieces = [fsdp.piece_tensors(opt, k, j) for k, j, _ in owned]
    with open(os.path.join(partial, name), "wb") as f:
        torch.save(dict(pieces=pieces, rng=torch.get_rng_state()), f)
        f.flush()
        os.fsync(f.fileno())  # on the disk before anyone calls the checkpoint complete
    path = os.path.join(partial, name)
    files = [None] * world
    dist.all_gather_object(files, (name, os.path.getsize(path), sha256(path), [list(p) for _, _, p in owned]))
    if rank == 0:
        meta = dict(step=step, world_size=world, layout=layout, params=shapes,
                    files={n: dict(bytes=size, sha256=digest, pieces=places) for n, size, digest, places in files})
        with open(os.path.join(partial, "meta.json"), "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.isdir(final):  # the same step saved again: the new one replaces it
            shutil.rmtree(final)
        os.rename(partial, final)  # atomic: from here on the checkpoint is complete
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)  # the rename itself on the disk
        os.close(fd)
        for _, old in complete_checkpoints(root)[:-keep or None] if keep else []:
            shutil.rmtree(old)
    dist.barrier()
    return final, files[rank][1]


def load(opt, where, path: str) -> int:
    """Continue from the checkpoint at `path`, written on any layout (checkpoint_problems has vetted it):
    each piece this rank owns is filled from the saved pieces it overlaps (fsdp.load_places), read from
    memory-mapped files, so only those pieces come off the disk. Returns the step it holds."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    opened = {}

    def file(name):  # memory-mapped: a tensor's bytes are read only where it is indexed
        if name not in opened:
            opened[name] = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True, mmap=True)
        return opened[name]

    saved = [((p[0], tuple(p[1]), p[2] and tuple(p[2]), p[3], p[4]), (name, n))
             for name, info in meta["files"].items() for n, p in enumerate(info["pieces"])]
    fsdp.load_places(opt, saved, lambda handle: file(handle[0])["pieces"][handle[1]], where)
    # the random-number state: this rank's where the world is the same size, else rank 0's
    mine = f"rank{dist.get_rank()}.pt"
    torch.set_rng_state(file(mine if meta["world_size"] == dist.get_world_size() else "rank0.pt")["rng"])
    return int(meta["step"])


# ---- plain state dicts: out of a sharded run, and into one ---------------------------------------------

@torch.no_grad()
def export(opt, where, path: str, *, shapes: dict, names: dict, dtype, device) -> None:
    """Write the whole model as ONE plain state dict {name: tensor} that load_state_dict(strict=True) accepts:
    `shapes` {parameter name: shape}, `names` {state-dict name: parameter name} (a tied weight under each of
    its names). Parameter by parameter, each rank sends rank 0 the pieces it owns (point to point); rank 0
    alone holds the whole model, as the file does, and writes it atomically (never a half file under the name)."""
    owned, every = owned_places(opt, where)
    rank, mine = dist.get_rank(), {p: (k, j) for k, j, p in owned}
    first, out = {}, {}
    for r, ps in enumerate(every):
        for p in ps:
            first.setdefault(p, r)
    for name, shape in shapes.items():
        full = torch.empty(math.prod(shape), dtype=dtype) if rank == 0 else None
        for r, p in ((r, p) for r, ps in enumerate(every) for p in ps if p[0] == name and first[p] == r):
            if r == rank:  # one order on every rank: the pieces of this parameter, rank by rank
                k, j = mine[p]
                values = opt.units[k].pieces[j][3].detach().to(dtype)
                if rank != 0:
                    dist.send(values.contiguous(), 0)
            elif rank == 0:
                values = torch.empty(p[4] - p[3], dtype=dtype, device=device)
                dist.recv(values, r)
            if rank == 0:
                full[fsdp.full_indices(*p[1:])] = values.cpu()
        if rank == 0:
            out[name] = full.view(shape)
    if rank == 0:
        torch.save({n: out[param] for n, param in names.items()}, path + ".partial")
        os.replace(path + ".partial", path)  # atomic: never a half-written file under the name
    dist.barrier()


@torch.no_grad()
def init_from(opt, where, path: str, read: str = "every-rank", *, dtype, device) -> None:
    """Start from a plain state dict (state_dict_problems has vetted it), the optimizer fresh. read:
    every-rank  every rank loads the whole file and keeps its pieces: the whole model on every rank at once;
    rank-0      rank 0 reads it (memory-mapped) and sends every rank exactly the elements of its pieces, point
                to point, piece by piece: the other ranks never hold more than their own pieces."""
    if read == "every-rank":
        sd = torch.load(path, map_location="cpu", weights_only=True)
        saved = [((n, tuple(t.shape), None, 0, t.numel()), n) for n, t in sd.items()]
        fsdp.load_places(opt, saved, lambda n: dict(value=sd[n].reshape(-1)), where)
        return
    rank = dist.get_rank()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [p for _, _, p in fsdp.places(opt, where)])
    sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True) if rank == 0 else None
    received = {}
    for r, ps in enumerate(every):  # one order on every rank
        for p in ps:
            if rank == 0:
                values = sd[p[0]].reshape(-1)[fsdp.full_indices(*p[1:])].to(dtype)
                if r == 0:
                    received[p] = values
                else:
                    dist.send(values.to(device), r)
            elif rank == r:
                values = torch.empty(p[4] - p[3], dtype=dtype, device=device)
                dist.recv(values, 0)
                received[p] = values.cpu()
    fsdp.load_places(opt, [(p, p) for p in received], lambda p: dict(value=received[p]), where)
