"""Checkpoint files for train.py: saved on any layout, loaded on any other, never half-written, never run.

What is in a checkpoint: every rank owns pieces of the model state (fsdp.py's slices of its flat units, each
piece one parameter's part), each with its place in the WHOLE tensor, and a loading rank copies from every saved
piece the elements that overlap its own (load_places, below). Then the file format around that algorithm, and its
safety:

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

Hugging Face model directories (config.json + safetensors, one file or shards named by an index) go both ways:
  in          config.json gives the model's shape (lab/hf.py); each rank reads only the rows and columns of the
              pieces it owns, through safetensors' lazy slices (a tp rank its columns, a ZeRO-3 rank its flat
              slice's rows, a pipeline rank its layers), or rank 0 reads and sends; hf_problems vets the
              directory on every rank before any collective; tokenizer.json, when there, tokenizes --data
  out         export_hf: config.json and model.safetensors (shards and an index above SHARD_BYTES), written by
              rank 0 one tensor at a time as the pieces arrive, the safetensors header first (every shape is
              known in advance): rank 0 holds one whole tensor at a time beyond its own part
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
from lab import hf
from lab.model import build_model

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


# ---- pieces: a state dict any layout can load (built on fsdp.py's slices) ---------------------------------
#
# A sharded state dict reloads only into the layout that wrote it. To resume on ANY layout — other world
# size, other ZeRO stage, tensor or pipeline parallel or not — each rank describes every piece it owns by
# where it sits in the WHOLE tensor, and a loading rank copies, from every saved piece, the elements that
# overlap its own (the idea behind torch.distributed.checkpoint's chunk metadata, written here by hand).
#
#   place = (name, full shape, narrow, lo, hi): the parameter this rank holds is the whole tensor narrowed
#           along one dimension — a tensor-parallel slice, or a rank's experts: narrow = (dim, start, end);
#           None: the whole tensor — and the piece is that tensor's flat elements [lo, hi) (ZeRO's slice).
#
# `where(name) -> (full shape, narrow)` says it for each parameter (its tp or expert slice). Copies of a
# piece on other ranks (data-parallel replicas, tp ranks sharing a kv head) have the same place: one of
# them writes it. Bytes: the job writes every element of model state once, (b_m + K)·Ψ in all (b_m the
# master's bytes, K the optimizer's per element); a loading rank reads about its own state, plus the rest
# of each saved piece that only partly overlaps it.

def places(opt, where=None) -> list:
    """[(unit index, piece index, place)] for every piece this rank owns."""
    out = []
    for k, u in enumerate(opt.units):
        lo = u.rank * u.shard_numel
        for j, (i, a, b, _) in enumerate(u.pieces):
            full_shape, narrow = where(u.names[i]) if where is not None else (u.shapes[i], None)
            start = lo + a - u.offsets[i]  # the piece's first element, as a flat index of the local parameter
            out.append((k, j, (u.names[i], tuple(full_shape), narrow and tuple(narrow), start, start + b - a)))
    return out


def full_indices(full_shape, narrow, lo: int, hi: int) -> torch.Tensor:
    """The flat indices, in the whole tensor, of elements [lo, hi) of the tensor narrowed by `narrow`: int64 [hi - lo],
    increasing (row-major order survives the narrowing)."""
    flat = torch.arange(lo, hi)
    if narrow is None:
        return flat
    dim, start, end = narrow
    shape = list(full_shape)
    shape[dim] = end - start
    index = list(torch.unravel_index(flat, shape))  # the multi-index in the narrowed tensor ...
    index[dim] = index[dim] + start                 # ... and in the whole one
    return sum(i * math.prod(full_shape[d + 1:]) for d, i in enumerate(index))


def _ends(place) -> tuple[int, int, bool]:
    """The first and last whole-tensor index of a place, without building them all (they increase), and
    whether the place is one contiguous run of the whole tensor (no narrow, or a narrow of dimension 0)."""
    name, full_shape, narrow, lo, hi = place
    first = int(full_indices(full_shape, narrow, lo, lo + 1)[0])
    last = int(full_indices(full_shape, narrow, hi - 1, hi)[0])
    return first, last, last - first == hi - lo - 1


def piece_tensors(opt, k: int, j: int) -> dict:
    """What a checkpoint keeps of piece j of unit k: its master values and its optimizer state."""
    q = opt.units[k].pieces[j][3]
    state = {n: v for n, v in opt.inner.state.get(q, {}).items() if isinstance(v, torch.Tensor)}
    return dict(value=q.detach(), **state)


@torch.no_grad()
def load_places(opt, saved: list, read, where=None) -> None:
    """Fill every piece this rank owns from saved pieces: saved [(place, handle)], read(handle) -> the
    piece_tensors dict it saved (tensors may stay on disk, memory-mapped: only what is indexed is read).
    A piece takes, from each saved piece of its parameter that overlaps it, the overlapping elements — of
    the master and of every optimizer state of the same size (the step count, a scalar, as it is). Raises
    if the saved pieces do not cover a piece. Afterwards the compute copies are refreshed (publish)."""
    by_name = {}
    for place, handle in saved:
        by_name.setdefault(place[0], []).append((place, _ends(place), handle))
    for k, j, place in places(opt, where):
        q, size = opt.units[k].pieces[j][3], place[4] - place[3]
        first, last, contiguous = _ends(place)
        mine, found, state = None, 0, {}
        for theirs_place, (t_first, t_last, t_contiguous), handle in by_name.get(place[0], []):
            if t_last < first or t_first > last:
                continue  # no overlap: not read at all
            if contiguous and t_contiguous:  # two runs of the whole tensor: their overlap is one slice of each
                a, b = max(first, t_first), min(last, t_last) + 1
                into, take = slice(a - first, b - first), slice(a - t_first, b - t_first)
                count = b - a
            else:  # match element by element: the whole-tensor indices of both, sorted
                mine = full_indices(*place[1:]) if mine is None else mine
                theirs = full_indices(*theirs_place[1:])
                pos = torch.searchsorted(theirs, mine).clamp(max=len(theirs) - 1)
                into = (theirs[pos] == mine).to(q.device)
                take, count = pos[into.cpu()], int(into.sum())
                if not count:
                    continue
            tensors = read(handle)
            q[into] = tensors["value"][take].to(q.device, q.dtype)
            for n, v in tensors.items():  # the optimizer state of the same elements; a step count as it is
                if n != "value":
                    if v.dim() == 0:
                        state[n] = v.clone()
                    else:
                        state.setdefault(n, torch.zeros_like(q))[into] = v[take].to(q.device, q.dtype)
            found += count
        if found != size:
            raise ValueError(f"the checkpoint covers {found} of the {size} elements of {place[0]} this rank "
                             f"holds: it was written for another model")
        if state:
            opt.inner.state[q] = state
        else:
            opt.inner.state.pop(q, None)
    for u in opt.units:
        u.publish()


# ---- saving and loading a training state: every piece with its place ----------------------------------
#
# opt is fsdp's ZeroOptimizer (it owns the pieces); where(name) -> (full shape, narrow) says where the
# parameter this rank holds sits in the whole model's (train.Trainer.where: a tp slice, my experts, or all).

def owned_places(opt, where):
    """This rank's pieces [(unit, piece, place)] that it writes — a piece several ranks hold (data-parallel
    replicas, tp ranks sharing a kv head) is written by the first of them — and every rank's places."""
    mine = places(opt, where)
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
    pieces = [piece_tensors(opt, k, j) for k, j, _ in owned]
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
    each piece this rank owns is filled from the saved pieces it overlaps (load_places), read from
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
    load_places(opt, saved, lambda handle: file(handle[0])["pieces"][handle[1]], where)
    # the random-number state: this rank's where the world is the same size, else rank 0's
    mine = f"rank{dist.get_rank()}.pt"
    torch.set_rng_state(file(mine if meta["world_size"] == dist.get_world_size() else "rank0.pt")["rng"])
    return int(meta["step"])


# ---- plain state dicts: out of a sharded run, and into one ---------------------------------------------

def _whole_tensors(opt, where, shapes: dict, dtype, device):
    """Yield (name, whole tensor) for every parameter of `shapes` in turn — on rank 0; None elsewhere: each rank
    sends rank 0 the pieces it owns of that parameter (point to point, one order on every rank), and rank 0
    holds one whole parameter at a time beyond its own pieces. Every rank must run the generator to its end."""
    owned, every = owned_places(opt, where)
    rank, mine = dist.get_rank(), {p: (k, j) for k, j, p in owned}
    first = {}
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
                full[full_indices(*p[1:])] = values.cpu()
        yield name, full.view(shape) if rank == 0 else None


@torch.no_grad()
def export(opt, where, path: str, *, shapes: dict, names: dict, dtype, device) -> None:
    """Write the whole model as ONE plain state dict {name: tensor} that load_state_dict(strict=True) accepts:
    `shapes` {parameter name: shape}, `names` {state-dict name: parameter name} (a tied weight under each of
    its names). Parameter by parameter, each rank sends rank 0 the pieces it owns (point to point); rank 0
    alone holds the whole model, as the file does, and writes it atomically (never a half file under the name)."""
    out = dict(_whole_tensors(opt, where, shapes, dtype, device))
    if dist.get_rank() == 0:
        torch.save({n: out[param] for n, param in names.items()}, path + ".partial")
        os.replace(path + ".partial", path)  # atomic: never a half-written file under the name
    dist.barrier()


@torch.no_grad()
def init_from(opt, where, path: str, read: str = "every-rank", *, dtype, device) -> int:
    """Start from a plain state dict or a Hugging Face model directory (state_dict_problems / hf_problems have
    vetted it), the optimizer fresh. read:
    every-rank  a plain file: every rank loads the whole file and keeps its pieces (the whole model on every rank
                at once); a directory: every rank reads only its pieces' rows (and columns) from the safetensors
    rank-0      rank 0 reads (memory-mapped) and sends every rank exactly the elements of its pieces, point to
                point, piece by piece: the other ranks never hold more than their own pieces, nor read the disk.
    Returns the bytes this rank read from the files (materialised tensors: a plain file loaded whole, its size)."""
    rank, directory = dist.get_rank(), os.path.isdir(path)
    if read == "every-rank" and not directory:
        sd = torch.load(path, map_location="cpu", weights_only=True)
        saved = [((n, tuple(t.shape), None, 0, t.numel()), n) for n, t in sd.items()]
        load_places(opt, saved, lambda n: dict(value=sd[n].reshape(-1)), where)
        return os.path.getsize(path)
    source = None
    if read == "every-rank" or rank == 0:
        source = HFDirectory(path) if directory else _PlainFile(path)
    if read == "every-rank":  # a directory: each of my pieces straight from the files
        mine = [p for _, _, p in places(opt, where)]
        load_places(opt, [(p, p) for p in mine], lambda p: dict(value=source.read(p)), where)
        return source.bytes_read
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [p for _, _, p in places(opt, where)])
    received = {}
    for r, ps in enumerate(every):  # one order on every rank
        for p in ps:
            if rank == 0:
                values = source.read(p).to(dtype)
                if r == 0:
                    received[p] = values
                else:
                    dist.send(values.to(device), r)
            elif rank == r:
                values = torch.empty(p[4] - p[3], dtype=dtype, device=device)
                dist.recv(values, 0)
                received[p] = values.cpu()
    load_places(opt, [(p, p) for p in received], lambda p: dict(value=received[p]), where)
    return source.bytes_read if source is not None else 0


class _PlainFile:
    """A plain state dict file, memory-mapped: read(place) -> that place's elements."""

    def __init__(self, path: str):
        self.sd, self.bytes_read = torch.load(path, map_location="cpu", weights_only=True, mmap=True), 0

    def read(self, place) -> torch.Tensor:
        values = self.sd[place[0]].reshape(-1)[full_indices(*place[1:])]
        self.bytes_read += values.numel() * values.element_size()
        return values


def whole_model(path: str) -> dict:
    """The course's whole state dict {name: tensor} from a plain file or a Hugging Face directory (one process:
    the single-process reference's start)."""
    if not os.path.isdir(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    source = HFDirectory(path)
    model = build_model(source.cfg, device="meta")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out = {n: source.read((n, s, None, 0, math.prod(s))).view(s).clone() for n, s in shapes.items()}
    first = {id(p): n for n, p in model.named_parameters()}   # a tied matrix under each of its state-dict names
    return {n: out[first[id(p)]] for n, p in model.named_parameters(remove_duplicate=False)}


# ---- Hugging Face model directories ----------------------------------------------------------------------

WEIGHTS, INDEX, TOKENIZER = "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
TOKENIZER_FILES = (TOKENIZER, "tokenizer_config.json", "special_tokens_map.json")  # copied on export
SHARD_BYTES = 5 * 2**30  # export_hf: a file of at most this many bytes (a bigger tensor gets a file alone)
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def is_hf_directory(path: str | None) -> bool:
    """--init-from names a directory (a Hugging Face model), not a file (a plain state dict)."""
    return path is not None and os.path.isdir(path)


def _tensor_files(path: str) -> dict:
    """{tensor name: its file} of the directory's safetensors (one file, or the shards the index names); a
    ValueError saying what is missing."""
    from safetensors import safe_open

    index = os.path.join(path, INDEX)
    try:
        if os.path.isfile(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(path, WEIGHTS)):
            with safe_open(os.path.join(path, WEIGHTS), framework="pt") as f:
                files = dict.fromkeys(f.keys(), WEIGHTS)
        else:
            raise ValueError(f"--init-from {path!r} holds neither {WEIGHTS} nor {INDEX}: save the model with "
                             f"save_pretrained (safetensors; .bin pickles are not read)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(str(e) if str(e).startswith("--init-from") else
                         f"--init-from {path!r}: its weights cannot be read ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]})") from None
    gone = sorted({f for f in files.values() if not os.path.isfile(os.path.join(path, f))})
    if gone:
        raise ValueError(f"--init-from {path!r}: {INDEX} names {len(gone)} files that are not there (first "
                         f"{gone[0]}): the download is incomplete")
    return files


def hf_problems(path: str, weights: bool = True) -> list[str]:
    """Everything that forbids starting from the Hugging Face directory at `path`, found by reading its
    config.json and the safetensors headers alone (no weights) — so every rank finds the same, before any
    collective: no config.json, or a model the course cannot express (lab/hf.py says which setting); no
    weights; a tensor missing, unexpected or of another shape; a tokenizer whose ids do not fit the vocabulary.
    weights=False (train.py --plan: a plan needs the shape, not the values): config.json alone, so a run is
    planned before its weights are downloaded."""
    from safetensors import safe_open

    try:
        cfg = hf.read_config(path)
        files = _tensor_files(path) if weights else {}
    except ValueError as e:
        return [str(e)]
    if not weights:
        return []
    _, shapes = hf.disk_map(cfg, set(files))
    problems = []
    missing = [n for n in shapes if n not in files]
    if missing:
        problems.append(f"--init-from {path!r} lacks {len(missing)} of the tensors its config.json's model has "
                        f"(first {missing[0]}): the weights do not belong to this config.json")
    extra = sorted(n for n in set(files) - set(shapes) if not hf.ignorable(n, cfg))
    if extra:
        problems.append(f"--init-from {path!r} holds {len(extra)} tensors the course's model has no place for "
                        f"(first {extra[0]}): not a model the course can train as it is")
    wrong, opened = [], {}
    for n in (n for n in shapes if n in files):
        if files[n] not in opened:
            opened[files[n]] = safe_open(os.path.join(path, files[n]), framework="pt")
        try:
            got = tuple(opened[files[n]].get_slice(n).get_shape())
        except Exception:  # noqa: BLE001 - the index names a tensor its file lacks: a missing tensor
            got = None
        if got != tuple(shapes[n]):
            wrong.append(f"{n}: file {got}, config.json's model {tuple(shapes[n])}")
    if wrong:
        problems.append(f"--init-from {path!r}: {len(wrong)} tensors do not have the shape config.json gives "
                        f"(first {wrong[0]})")
    try:
        tok = tokenizer_of(path)
    except ValueError as e:
        problems.append(str(e))
    else:
        if tok is not None and tok.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
            problems.append(f"--init-from {path!r}: {TOKENIZER} has {tok.get_vocab_size(with_added_tokens=True)} "
                            f"tokens, the model's vocabulary {cfg.vocab_size}: its ids would not fit the embedding")
    return problems


def tokenizer_of(path: str | None):
    """The tokenizer of a model directory (its tokenizer.json, read by the `tokenizers` library), or None when
    there is none (byte tokens); a ValueError when it cannot be read."""
    if not is_hf_directory(path) or not os.path.isfile(os.path.join(path, TOKENIZER)):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(os.path.join(path, TOKENIZER))
    except Exception as e:  # noqa: BLE001 - whatever the library refuses, refused here alike on every rank
        raise ValueError(f"--init-from {path!r}: {TOKENIZER} cannot be read by the tokenizers library "
                         f"({str(e).splitlines()[0][:200]})") from None


class HFDirectory:
    """A Hugging Face model directory opened for reading, lazily: read(place) materialises only the rows (and
    columns) of the files that hold the place's elements, and counts their bytes in bytes_read.

    A place (the pieces section above) is elements [lo, hi) of the whole tensor narrowed along one dimension. Seen as
    rows (hf.disk_map: every dimension but the last merged), those elements lie in a run of rows of the narrowed
    tensor — and so of the whole one: a narrow of dimension 0 (tp's column-parallel slices, a rank's experts)
    shifts the run, a narrow of the last (row-parallel slices) keeps the rows and takes their columns [start, end).
    What is read beyond the place is at most the rest of its first and last rows (of the narrowed tensor)."""

    def __init__(self, path: str):
        self.path, self.cfg, self.files = path, hf.read_config(path), _tensor_files(path)
        self.parts, self.shapes = hf.disk_map(self.cfg, set(self.files))
        self.opened, self.bytes_read = {}, 0
        names = {v: k for k, v in SAFETENSORS_DTYPES.items()}   # (a padded row's zeros: in the files' dtype)
        self.dtype = names.get(self._slice(next(iter(self.shapes))).get_dtype(), torch.float32)

    def _slice(self, tensor: str):
        from safetensors import safe_open

        f = self.files[tensor]
        if f not in self.opened:
            self.opened[f] = safe_open(os.path.join(self.path, f), framework="pt")
        return self.opened[f].get_slice(tensor)

    def rows(self, name: str, a: int, b: int, cols: slice) -> torch.Tensor:
        """Rows [a, b) of the course's whole tensor `name` (columns `cols`), read from the blocks that hold them:
        [b - a, columns]."""
        out, first = [], 0
        for tensor, index, row, n, transposed in self.parts[name]:
            lo, hi = max(a, first), min(b, first + n)
            if lo < hi:
                rows = slice(row + lo - first, row + hi - first)
                if tensor is None:  # a padded vocabulary's rows: in no file
                    block = torch.zeros(hi - lo, cols.stop - cols.start, dtype=self.dtype)
                elif transposed:  # (GPT-2's Conv1D: my rows are the file tensor's columns, my columns its rows)
                    block = self._slice(tensor)[cols, rows].T
                elif len(self.shapes[tensor]) == 1:  # a vector: one element a row
                    block = self._slice(tensor)[rows][:, None]
                else:  # (index: this block's expert of a stacked tensor)
                    block = self._slice(tensor)[(*(slice(i, i + 1) for i in index), rows, cols)].reshape(hi - lo, -1)
                self.bytes_read += block.numel() * block.element_size() if tensor is not None else 0
                out.append(block)
            first += n
        return torch.cat(out)

    def read(self, place) -> torch.Tensor:
        """The place's elements [hi - lo], flat, in the file's dtype."""
        name, shape, narrow, lo, hi = place
        shape = list(shape) if len(shape) > 1 else [shape[0], 1]
        local, cols, shift = list(shape), slice(0, shape[-1]), 0
        if narrow is not None:
            dim, start, end = narrow
            local[dim] = end - start
            if dim == len(shape) - 1:
                cols = slice(start, end)               # the same rows, my columns
            elif dim == 0:
                shift = start * math.prod(local[1:-1])  # my rows, shifted
            else:
                raise ValueError(f"{name}: a narrow of dimension {dim} (the course's lessons narrow the first or "
                                 f"the last)")
        width = local[-1]
        a, b = lo // width, (hi - 1) // width + 1   # the rows of the narrowed tensor that hold [lo, hi)
        block = self.rows(name, a + shift, b + shift, cols)
        return block.reshape(-1)[lo - a * width:hi - a * width]


def _safetensors_header(tensors: list, dtype) -> bytes:
    """The header of a safetensors file holding `tensors` [(name, shape)] in this order, all of `dtype`: its
    length (8 bytes, little-endian), then JSON — each tensor's dtype, shape and byte range — padded to 8 bytes."""
    header, at, size = {"__metadata__": {"format": "pt"}}, 0, torch.empty((), dtype=dtype).element_size()
    for name, shape in tensors:
        n = math.prod(shape) * size
        header[name] = dict(dtype=SAFETENSORS_DTYPES[dtype], shape=list(shape), data_offsets=[at, at + n])
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


@torch.no_grad()
def export_hf(opt, where, path: str, *, cfg, shapes: dict, dtype, device, copy_from: str | None = None) -> dict:
    """Write the model as a Hugging Face directory that transformers' from_pretrained loads: config.json
    (hf.hf_config: Llama, Mixtral with experts, or GPT-2) and the weights under save_pretrained's names (Mixtral per
    expert; GPT-2's Conv1D weights transposed, its q, k, v one c_attn; a tied head once; a padded vocabulary's extra
    rows left out), in model.safetensors — or, above SHARD_BYTES, in shards named by model.safetensors.index.json.
    Every file's header is known before any weight moves (the shapes are), so rank 0 writes each file tensor as soon
    as the course tensors it is made of have arrived (_whole_tensors): one whole tensor at a time beyond its own part
    (GPT-2's c_attn: q, k and v, until the three are there). The tokenizer files of `copy_from` go along. Atomic:
    written under path + '.partial', renamed when complete. Returns {file tensor: file}."""
    parts, disk_shapes = hf.disk_map(cfg, {"lm_head.weight"})  # untied (unless cfg ties), per expert: as saved
    blocks = {}  # file tensor -> [(course name, block)]: what it is made of
    for name in shapes:
        for part in (p for p in parts[name] if p[0] is not None):
            blocks.setdefault(part[0], []).append((name, part))
    complete_at, arrived, listed = {}, set(), set()  # course name -> the file tensors complete once it arrives
    for name in shapes:
        arrived.add(name)
        complete_at[name] = [t for t in dict.fromkeys(p[0] for p in parts[name] if p[0] is not None)
                             if t not in listed and all(n in arrived for n, _ in blocks[t])]
        listed.update(complete_at[name])
    size = torch.empty((), dtype=dtype).element_size()
    groups, held = [[]], 0  # the file tensors of each file, in the order they are written
    for t in (t for name in shapes for t in complete_at[name]):
        if groups[-1] and held + math.prod(disk_shapes[t]) * size > SHARD_BYTES:
            groups.append([])
            held = 0
        groups[-1].append(t)
        held += math.prod(disk_shapes[t]) * size
    file_names = [WEIGHTS] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                                     for i in range(len(groups))]
    weight_map = {t: f for f, group in zip(file_names, groups) for t in group}
    rank, partial = dist.get_rank(), path + ".partial"
    out, filling = None, {}  # filling: file tensors made of several course tensors, being put together
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # what an export that died left behind
        os.makedirs(partial)
        config = hf.hf_config(cfg)
        config.dtype, config.architectures = dtype, [hf.architecture(config)]
        config.save_pretrained(partial)
    for name, full in _whole_tensors(opt, where, shapes, dtype, device):
        if rank != 0:
            continue
        rows, first, whole = full.reshape(hf._rows(full.shape), -1), 0, {}
        for part in parts[name]:  # each block: the next part[3] rows of the course's tensor
            t, block = part[0], rows[first:first + part[3]]
            first += part[3]
            if t is not None and len(blocks[t]) == 1:  # the whole file tensor (GPT-2's Conv1D: transposed)
                whole[t] = block.T if part[4] else block
            elif t is not None:  # (a padded vocabulary's rows, t None: not exported)
                if t not in filling:
                    filling[t] = torch.empty(disk_shapes[t], dtype=dtype)
                hf.write_rows(filling, part, block)
        for t in complete_at[name]:
            if out is None or out.name != os.path.join(partial, weight_map[t]):  # the next file: its header first
                _close(out)
                out = open(os.path.join(partial, weight_map[t]), "wb")
                group = groups[file_names.index(weight_map[t])]
                out.write(_safetensors_header([(u, disk_shapes[u]) for u in group], dtype))
            data = whole.pop(t) if t in whole else filling.pop(t)
            out.write(data.contiguous().view(torch.uint8).numpy().tobytes())
    if rank == 0:
        _close(out)
        if len(file_names) > 1:
            with open(os.path.join(partial, INDEX), "w") as f:
                total = sum(math.prod(disk_shapes[t]) * size for t in weight_map)
                json.dump(dict(metadata=dict(total_size=total), weight_map=weight_map), f, indent=2)
        for name in TOKENIZER_FILES if is_hf_directory(copy_from) else ():
            if os.path.isfile(os.path.join(copy_from, name)):
                shutil.copy(os.path.join(copy_from, name), partial)
        os.rename(partial, path)  # atomic: from here on the directory is complete
    dist.barrier()
    return weight_map


def _close(f) -> None:
    if f is not None:
        f.flush()
        os.fsync(f.fileno())  # on the disk before the directory is renamed complete
        f.close()
