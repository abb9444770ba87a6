"""Lesson 0 — ranks, process groups, collectives, and the device mesh.

The idea
--------
A distributed job is P copies of one program. Each copy (a *rank*) learns its
number from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), joins the default process group, and from then on
talks to the others only through *collectives* on *process groups* (subsets of
ranks).

Every parallelism in this course lives on one axis of a 5-D grid of ranks,

    [pp, dp_replicate, dp_shard, cp, tp]        (tp innermost)

so rank = ((((pp_i * R + r_i) * D + d_i) * C + c_i) * T + t_i). Consecutive
ranks share a tp group: tensor parallel talks every layer, so it gets the
fastest links (the GPUs of one node); pipeline parallel talks least and is
outermost. A *process group* along dimension `dim` is the set of ranks whose
coordinates agree on every other dimension.

Communication of each collective (per rank, ring algorithm, N elements of b bytes):
    all-reduce      2 (P-1)/P · N·b        reduce-scatter  (P-1)/P · N·b
    all-gather      (P-1)/P · N·b          all-to-all      (P-1)/P · N·b
    broadcast       N·b                    send/recv       N·b

Expert parallel (ep) adds no dimension: it *borrows* ranks from the
data-parallel dimensions, as torchtitan does. The flattened data-parallel rank
d = r_i * D + d_i (0 <= d < dp_replicate*dp_shard) is split as d = e_out * ep + e_i:
  - "ep"  group: ranks with the same e_out  (ep consecutive dp ranks, which hold
    different experts and exchange tokens with all-to-all);
  - "edp" group: ranks with the same e_i (they hold copies of the same experts,
    and average those experts' gradients). ep must divide dp_replicate*dp_shard.

Ranks pair the collectives on a group by the order they issue them, nothing else: `agree` has every
rank say its next collective, and `agree_step` checks every rank said the same before a step is applied
(through the job's key-value store), so ranks that disagree stop with one error naming each rank's
collective (lesson 2 calls them before each of its collectives and before its optimizer's step).
"""
from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist

from lab import collective_watch as guard
from lab.launch import free_port

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened dimensions the lessons need: data parallel (gradients averaged over it),
# data x context parallel (the loss and gradients are averaged over all of it: cp
# ranks hold different tokens of the same sequences), and the FSDP shard group
# when cp > 1 (parameters are sharded over dp_shard x cp, as torchtitan does).
FLAT = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}


def rows_along(grid: torch.Tensor, names: tuple, along: tuple) -> list[list[int]]:
    """Every group along the axes `along` of a grid of ranks whose axes are `names`: move those axes last and
    read off the rows, one per setting of the other axes (members in grid order)."""
    others = [n for n in names if n not in along]
    size = math.prod(grid.shape[names.index(n)] for n in along)
    return grid.permute([names.index(n) for n in others + list(along)]).reshape(-1, size).tolist()


class Mesh:
    """The 5-D grid of ranks [pp, dp_replicate, dp_shard, cp, tp] and its process groups.

    Every group is built by hand from rank arithmetic. `dist.new_group` is itself
    a collective over the *whole world*: every rank must call it for every group,
    members or not, and in the same order, or ranks would pair up different
    groups under the same internal id (and hang or mix up traffic). So each rank
    walks the same nested loops and keeps only the groups it belongs to.
    """

    def __init__(self, *, pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1,
                 cp: int = 1, tp: int = 1, ep: int = 1, world_size: int | None = None,
                 rank: int | None = None):
        self.shape = dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp)
        self.ep = ep
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        validate_mesh(self.shape, world_size, ep)  # pure arithmetic: raises on every rank alike
        self.world_size, self.global_rank = world_size, rank
        # The grid itself: grid[i_pp, i_r, i_d, i_c, i_t] is the rank at those coordinates (tp fastest).
        self.grid = torch.arange(world_size).view(*self.shape.values())
        self.coords = dict(zip(DIMS, (int(i) for i in (self.grid == rank).nonzero()[0])))

        self._groups: dict[str, object] = {}
        self._ranks: dict[str, list[int]] = {}
        for name, dims in [(d, (d,)) for d in DIMS] + list(FLAT.items()):
            self._build(name, self.groups_along(dims))
        for name, groups in self._expert_groups(ep).items():
            self._build(name, groups)

    def _expert_groups(self, ep: int) -> dict:
        """Expert parallel borrows ep consecutive data-parallel ranks (as torchtitan does): the flattened dp rank
        d = r_i·D + d_i is split as d = e_out·ep + e_i, which views the grid as [pp, e_out, e_i, cp, tp].
          ep      along e_i: ep ranks holding different experts, which exchange tokens all-to-all
          edp     along e_out: the ranks holding copies of the same experts
          edp_cp  along e_out and cp: cp ranks hold other tokens of the same sequences, so copies too"""
        pp, cp, tp = self.shape["pp"], self.shape["cp"], self.shape["tp"]
        names = ("pp", "e_out", "e_i", "cp", "tp")
        grid = self.grid.reshape(pp, -1, ep, cp, tp)  # dp_replicate x dp_shard flattened, then split
        return {"ep": rows_along(grid, names, ("e_i",)), "edp": rows_along(grid, names, ("e_out",)),
                "edp_cp": rows_along(grid, names, ("e_out", "cp"))}

    def groups_along(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Every group along `dims` of the mesh (rows_along its grid)."""
        return rows_along(self.grid, DIMS, dims)

    def rank_of(self, coords: dict) -> int:
        return int(self.grid[tuple(coords[d] for d in DIMS)])

    def _build(self, name: str, rank_lists: list[list[int]]) -> None:
        for ranks in rank_lists:
            # Every rank calls new_group for every list, in the same order (see class doc).
            group = _group_of(ranks) if dist.is_initialized() else None
            if self.global_rank in ranks:
                self._groups[name], self._ranks[name] = group, ranks

    # ---- accessors ---------------------------------------------------------------
    def size(self, dim: str) -> int:
        return len(self._ranks[dim])

    def rank(self, dim: str) -> int:
        """This rank's index inside its `dim` group."""
        return self._ranks[dim].index(self.global_rank)

    def group(self, dim: str):
        return self._groups[dim]

    def ranks(self, dim: str) -> list[int]:
        """The global ranks of this rank's `dim` group, in group order."""
        return list(self._ranks[dim])

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{d}={self.shape[d]}" for d in DIMS) + f", ep={self.ep})"


_GROUPS: dict = {}


def _group_of(ranks: list[int]):
    """dist.new_group(ranks), made once per job: a process that builds many meshes in turn (a test, a search)
    reuses a group of the same ranks rather than opening another (each is sockets and threads that stay). Every rank
    builds the same lists in the same order, so every rank finds the same ones already made."""
    if _GROUPS.get("world") is not dist.group.WORLD:   # a new job in this process (init_process_group again)
        _GROUPS.clear()
        _GROUPS["world"] = dist.group.WORLD
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks)
    return _GROUPS[key]


def resolve_group(group, dim: str = "dp"):
    """A lesson's `group` argument: a Mesh (its `dim` group), a process group, or None (the world)."""
    if isinstance(group, Mesh):
        return group.group(dim)
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    raise ValueError(f"group must be a Mesh (its {dim!r} group is used), a ProcessGroup or None (the "
                     f"whole world), got {type(group).__name__}")


def collective_device(group=None) -> torch.device:
    """Where `group`'s collectives take their tensors: this rank's GPU under NCCL, else the CPU (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_flat(tensors, group=None, divide_by: int = 1) -> None:
    """All-reduce a list of tensors as ONE flat buffer (one call, not one per tensor), in place;
    divide by `divide_by` afterwards (gloo has no ReduceOp.AVG: sum, then divide)."""
    tensors = list(tensors)
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def mesh_problems(shape: dict, world_size: int, ep: int = 1) -> list[str]:
    """What is wrong with these sizes as a mesh for `world_size` ranks: one sentence each, naming the fix."""
    sizes = ", ".join(f"{d}={shape[d]}" for d in DIMS)
    if any(not isinstance(shape[d], int) or shape[d] < 1 for d in DIMS) or not isinstance(ep, int) or ep < 1:
        return [f"mesh sizes must be integers >= 1, got {sizes}, ep={ep}"]
    problems, product, dp = [], math.prod(shape[d] for d in DIMS), shape["dp_replicate"] * shape["dp_shard"]
    if product != world_size:
        problems.append(f"mesh {sizes} has {product} ranks but the world size is {world_size}: "
                        f"choose sizes whose product pp*dp_replicate*dp_shard*cp*tp equals {world_size} "
                        f"(or launch with torchrun --nproc_per_node {product})")
    if dp % ep != 0:
        problems.append(f"ep={ep} borrows ranks from data parallel (dp_replicate*dp_shard={dp}) and must divide "
                        f"it: choose ep from {[e for e in range(1, dp + 1) if dp % e == 0]}")
    return problems


def validate_mesh(shape: dict, world_size: int, ep: int = 1) -> None:
    """Raise one ValueError saying everything mesh_problems finds (arithmetic only: before any collective)."""
    problems = mesh_problems(shape, world_size, ep)
    if problems:
        raise ValueError("; and ".join(problems))


# ---- collectives that say what they are: ranks that disagree stop with one error ------------------------
# Ranks pair collectives by the order they issue them on a group, and by nothing else. A rank that makes one
# more (a module only it runs, under ZeRO-3), one fewer, or the same ones in another order pairs its call with
# whatever its peers do next: a different size aborts the process (gloo), an equal size silently hands each
# rank the other's data (a swapped unit), NCCL waits forever. So before each collective a lesson makes from a
# model's hooks, `agree` says in one line what this rank is about to do ("gathers unit 0 (tok_embeddings) for
# forward"), and before its optimizer applies a step, `agree_step` checks that every rank's lines of the step
# were the same — through the job's key-value store, the one the ranks met at (not a collective: it cannot itself
# be mismatched, and the bytes on the wire stay what the formulas say). Cheaply: a line equal to the one at the
# same place of the last step (which every rank agreed on) costs nothing; a new line is agreed on its own before
# its collective runs; the step's lines are agreed once, a few store round trips, before anything is applied. Lines
# that differ: every rank raises the same error, naming each rank's collective, no update applied; a peer that
# never comes: after the collective timeout, the error names its last line. COURSE_CHECK_COLLECTIVES=0 turns it
# off. (lab/collective_watch.py holds how: the guard; its --watch checks every collective and transfer.)


def checking_collectives() -> bool:
    return os.environ.get("COURSE_CHECK_COLLECTIVES", "1") != "0"


def agree(group, what: str, fix: str = "") -> None:
    """Before a collective on `group`: this rank says `what` it is about to do; raise RuntimeError on every rank of
    the group when their lines differ. No-op for a group of one, a fake group (a memory plan) or when turned off."""
    if checking_collectives():
        guard.announce(group, what, fix, timeout_seconds())


def agree_step(fix: str = "", groups=()) -> None:
    """Before an optimizer applies a step: every rank's collectives since the last step agreed at once;
    raise RuntimeError on every rank, before anything is applied, when they differ. `groups`: the groups the step
    reduces over (every rank of them takes part)."""
    if checking_collectives():
        guard.settle(fix, groups, timeout_seconds())


# ---- running for real: joining the job, torch's names, restarts --------------------------------------
# Not the idea of a mesh, but what every run needs around it: how a process joins the job (torchrun or a plain
# `python file.py`), how long a collective may wait, the flat collectives' names across torch versions, and a
# torchrun restart's store (lesson 8's crash-and-resume).

# torch 2.13 renamed the flat-tensor all-gather and reduce-scatter (the old names now warn);
# torch 2.11 has only the old names. Lessons call these two, which work on both.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def timeout_seconds() -> float:
    """How long a collective may wait before it fails (COURSE_TIMEOUT, default 120 s)."""
    return float(os.environ.get("COURSE_TIMEOUT", "120"))


def init_distributed(backend: str | None = None) -> torch.device:
    """Join the default process group and return this rank's device.

    Under torchrun the environment names rank and world size. Under plain
    `python file.py` there is none, and we start a world of one rank, so every
    lesson runs unchanged (its collectives then move nothing).
    NCCL when CUDA is available, gloo otherwise; `backend` overrides.
    """
    if "RANK" not in os.environ:  # plain `python file.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_seconds())
        kwargs = dict(backend=backend, timeout=timeout)
        if backend == "nccl":
            kwargs["device_id"] = device  # binds the communicator to our GPU up front
        kwargs.update(_restart_store(timeout))
        dist.init_process_group(**kwargs)
    return device


def _restart_store(timeout) -> dict:
    """A job torchrun restarts (`--max-restarts`) needs one more thing. Every group is built through a
    key-value store: each rank publishes its address under a key and reads its peers'. torchrun's
    single-node launcher keeps ONE store across attempts, so after a restart the old attempt's keys are
    still there, and a new rank can read a dead rank's address and fail to connect, or hang. So under
    torchrun every attempt gets its own key namespace
    (TORCHELASTIC_RESTART_COUNT), which every group built later inherits. Returns init_process_group's
    extra arguments ({} outside torchrun's agent)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    # the launcher's store (it serves it; we are clients), seen through this attempt's prefix
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dict(store=dist.PrefixStore(f"attempt_{attempt}", agent),
                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":  # the demo (every collective once, checked and counted) is in the package
    from lab.mesh_demo import main
    main()
