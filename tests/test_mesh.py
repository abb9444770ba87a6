"""mesh.py: group ranks by arithmetic, against PyTorch's DeviceMesh, and its errors."""

import re
import pytest
import torch.distributed as dist

from harness import Exercise, run_ranks, run_script
from mesh import DIMS, FLAT, Mesh


def _all_groups(shape, world, dim, ep=1):
    """The set of distinct `dim` groups over all ranks, from pure arithmetic (no processes)."""
    return {tuple(Mesh(**shape, ep=ep, world_size=world, rank=r).ranks(dim)) for r in range(world)}


@pytest.mark.parametrize("shape", [dict(tp=8), dict(dp_shard=2, tp=4), dict(pp=2, dp_replicate=2, cp=2),
                                   dict(pp=2, dp_shard=2, tp=2), dict(dp_replicate=2, dp_shard=2, cp=2)])
def test_groups_partition_the_world(shape):
    for dim in DIMS + tuple(FLAT) + ("ep", "edp", "edp_cp"):
        groups = _all_groups(shape, 8, dim)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(8)), (dim, groups)  # every rank in exactly one group
        dims = FLAT.get(dim, (dim,)) if dim not in ("ep", "edp", "edp_cp") else ()
        want = 1
        for d in dims:
            want *= shape.get(d, 1)
        if dims:
            assert all(len(g) == want for g in groups), (dim, groups)


def test_tp_is_innermost_and_coords_roundtrip():
    m = [Mesh(pp=2, dp_shard=2, tp=2, world_size=8, rank=r) for r in range(8)]
    assert m[0].ranks("tp") == [0, 1] and m[2].ranks("tp") == [2, 3]
    assert m[0].ranks("dp_shard") == [0, 2] and m[0].ranks("pp") == [0, 4]
    for r in range(8):
        assert m[r].rank_of(m[r].coords) == r


def test_ep_borrows_from_data_parallel():
    shape = dict(dp_replicate=2, dp_shard=2, tp=2)
    ep = _all_groups(shape, 8, "ep", ep=2)
    edp = _all_groups(shape, 8, "edp", ep=2)
    # dp groups are {0,2,4,6} and {1,3,5,7}; ep splits each into consecutive pairs.
    assert ep == {(0, 2), (4, 6), (1, 3), (5, 7)}
    assert edp == {(0, 4), (2, 6), (1, 5), (3, 7)}


def test_edp_cp_holds_every_copy_of_my_experts():
    # dp 4 (ranks 0,2,4,6 at cp 0), cp 2, ep 2: experts e_i = 0 live on dp ranks 0 and 4 (edp) and
    # on their cp partners 1 and 5; the ep groups stay inside one cp index.
    shape = dict(dp_shard=4, cp=2)
    assert _all_groups(shape, 8, "ep", ep=2) == {(0, 2), (4, 6), (1, 3), (5, 7)}
    assert _all_groups(shape, 8, "edp_cp", ep=2) == {(0, 1, 4, 5), (2, 3, 6, 7)}
    for r in range(8):
        m = Mesh(**shape, ep=2, world_size=8, rank=r)
        assert set(m.ranks("edp")) <= set(m.ranks("edp_cp")) and len(m.ranks("edp_cp")) == m.size("edp") * 2


def test_grid_is_the_rank_tensor():
    m = Mesh(pp=2, dp_shard=2, tp=2, world_size=8, rank=5)
    assert m.grid.shape == (2, 1, 2, 1, 2) and m.grid[1, 0, 0, 0, 1] == 5
    assert m.coords == dict(pp=1, dp_replicate=0, dp_shard=0, cp=0, tp=1)


@pytest.mark.parametrize("bad, msg", [(dict(dp_shard=3), "world size is 4"), (dict(tp=0, dp_shard=4), ">= 1"),
                                      (dict(dp_shard=2, tp=2, ep=4), "must divide"),
                                      (dict(dp_shard=2, tp=1), "has 2 ranks")])
def test_bad_mesh_raises_without_processes(bad, msg):
    with pytest.raises(ValueError, match=msg):
        Mesh(**bad, world_size=4, rank=0)


def _bad_mesh_on_every_rank():
    from lab.instruments import CommCounter
    with CommCounter() as c:
        try:
            Mesh(dp_shard=3)
        except ValueError as e:
            return str(e), c.calls()
    return None, c.calls()


def _compare_with_device_mesh(shapes):
    from torch.distributed.device_mesh import init_device_mesh
    out = []
    for shape in shapes:
        mine = Mesh(**shape)
        sizes = tuple(shape.get(d, 1) for d in DIMS)
        dm = init_device_mesh("cpu", sizes, mesh_dim_names=DIMS)
        for d in DIMS:
            theirs = dist.get_process_group_ranks(dm.get_group(d))
            out.append((shape, d, mine.ranks(d), theirs))
        for name, dims in FLAT.items():
            out.append((shape, name, mine.ranks(name), sorted(dm[dims].mesh.flatten().tolist())))
    return out


def test_bad_mesh_raises_on_every_rank_before_any_collective():
    for msg, calls in run_ranks(_bad_mesh_on_every_rank, 2, timeout=60):
        assert msg is not None and "dp_shard=3" in msg and "world size is 2" in msg
        assert calls == 0


def test_groups_equal_init_device_mesh_on_8_ranks():
    shapes = [dict(tp=8), dict(dp_shard=2, tp=4), dict(pp=2, dp_replicate=2, dp_shard=2),
              dict(pp=2, dp_shard=2, cp=2), dict(dp_replicate=2, cp=2, tp=2)]
    results = run_ranks(_compare_with_device_mesh, 8, shapes, timeout=180)
    n = 0
    for per_rank in results:
        for shape, dim, mine, theirs in per_rank:
            assert mine == theirs, (shape, dim, mine, theirs)
            n += 1
    assert n == 8 * len(shapes) * (len(DIMS) + len(FLAT))


@pytest.mark.parametrize("nproc", [None, 4])
def test_demo_runs(nproc):
    out = run_script("mesh.py", nproc=nproc, timeout=180)
    assert "every collective checked on every rank: ok" in out and "WRONG" not in out
    if nproc == 4:  # the ring bytes of each collective equal the formula (the last two columns)
        for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
            line = next(l for l in out.splitlines() if l.strip().startswith(name) and "," in l)
            api, wire, formula = line.split()[-3:]
            assert wire == formula, line


def _check_groups(out):
    # 8 ranks as pp 2 x dp_shard 2 x tp 2: tp pairs consecutive ranks, pp pairs ranks 4 apart
    assert "rank 0: coords {'pp': 0, 'dp_replicate': 0, 'dp_shard': 0, 'cp': 0, 'tp': 0}" in out
    block = out.split("rank 5:")[1].split("rank 6:")[0]
    assert "tp           group [4, 5]" in block and "pp           group [1, 5]" in block
    assert "dp_shard     group [5, 7]" in block


def _check_bad(out):
    assert out.count("has 3 ranks but the world size is 4") == 4  # one line from every rank
    assert 'mesh.py", line' not in out  # no traceback of ours (torchrun still reports the exit codes)


def _check_bytes(out):
    line = next(l for l in out.splitlines() if l.strip().startswith("all_reduce") and "," in l)
    api, wire, formula = (float(v.replace(",", "")) for v in line.split()[-3:])
    assert api == 3360 and wire == formula == 2 * 3 / 4 * 3360  # 2(P-1)/P of the API bytes at P = 4


EXERCISES = [
    Exercise("torchrun --nproc_per_node 8 mesh.py --pp 2 --dp-shard 2 --tp 2", _check_groups),
    Exercise("torchrun --nproc_per_node 4 mesh.py --dp-shard 3", _check_bad, fails=True),
    Exercise("torchrun --nproc_per_node 4 mesh.py", _check_bytes),
]


# ---- mesh.agree: ranks say what collective comes next, and disagree with one error ------------------------

def _agree_cases():
    import datetime
    import os
    import time
    from mesh import agree
    r, out = dist.get_rank(), {}
    sub = dist.new_group([0, 1])  # (every rank builds every group)
    for i in range(3):  # the same line on every rank, three times over: nothing happens, on either group
        agree(None, f"all-reduces step {i}'s flags")
        if r < 2:
            agree(sub, "gathers unit 1")
    try:  # different lines: every rank raises the same error, naming each rank's
        agree(None, f"gathers unit {r % 2}", "Fix it alike.")
    except RuntimeError as e:
        out["differ"] = str(e)
    os.environ["COURSE_CHECK_COLLECTIVES"] = "0"  # turned off: nothing is compared
    agree(None, f"gathers unit {r}")
    del os.environ["COURSE_CHECK_COLLECTIVES"]
    start = time.perf_counter()
    store = dist.distributed_c10d._get_default_store()
    try:  # rank 0 announces one more collective than the others: after the timeout it says who never came
        if r == 0:   # (a timeout of 3 s, not the job's: the store waits that long, the message says so)
            os.environ["COURSE_TIMEOUT"] = "3"
            store.set_timeout(datetime.timedelta(seconds=3))
            agree(None, "gathers unit 7 for forward")
    except RuntimeError as e:
        out["missing"] = (str(e), time.perf_counter() - start)
    store.set_timeout(datetime.timedelta(seconds=30))  # the others wait for it there, not in a collective
    store.set("agreed", "done") if r == 0 else store.wait(["agreed"], datetime.timedelta(seconds=30))
    return out


def test_agree_names_each_ranks_collective_when_they_differ_and_who_never_came():
    results = run_ranks(_agree_cases, 3, timeout=60)
    want = ("the ranks of group [0, 1, 2] disagree on their next collective: rank 0 gathers unit 0; rank 1 gathers "
            "unit 1; rank 2 gathers unit 0. Fix it alike.")
    assert [r["differ"] for r in results] == [want] * 3, results
    msg, seconds = results[0]["missing"]
    assert re.match(r"rank 0 gathers unit 7 for forward, but rank 1 never reached its next collective over "
                    r"ranks \[0, 1, 2\] \(its last: gathers unit 1(; it waits at \S+ in \w+)?\); rank 2 never reached "
                    r"its next collective over ranks \[0, 1, 2\] \(its last: gathers unit 0(; it waits at \S+ in \w+)?\) "
                    r"within 3 s\.", msg), msg
    assert 3 <= seconds < 8, (msg, seconds)
    assert "missing" not in results[1] and "missing" not in results[2]
