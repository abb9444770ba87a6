"""Data parallel (ddp.py) equals one process on the global batch, at 2 and 4 ranks.

All configurations run inside one spawned group per world size (spawning costs seconds); the ranks
return what they measured and the tests compare it with lab.baseline.single_process on the same batches.
"""
import contextlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from lab import references

from ddp import MiB, BucketedDDP, NaiveDDP
from lab.baseline import max_diff, single_process, snapshot
from harness import Exercise, global_batches, reference_model, run_ranks, run_script
from lab.instruments import CommCounter, ProfileSpans, overlap_fraction
from mesh import Mesh
from lab.model import build_model

STEPS, B, S, LR = 3, 8, 16, 1e-3
K = 2  # micro-batches for no_sync
N_PARAMS = len(list(reference_model("tiny").parameters()))
NUMEL = sum(p.numel() for p in reference_model("tiny").parameters())
FLAGS = N_PARAMS  # the used-flags agreement: one uint8 per parameter tensor, one all-reduce per step


def grad_bytes(dtype):
    return NUMEL * dtype.itemsize


def caps(dtype):
    """(bucket_cap_mb, first_bucket_mb) giving exactly one bucket (the whole model), two, one per parameter."""
    return {"one": (25, 25), "two": (0.6 * grad_bytes(dtype) / MiB,) * 2, "many": (0, 0)}

# Both runs are in float64, where "equal" can mean 1e-10: AdamW divides by sqrt(v), so in fp32 rounding on a
# near-zero gradient becomes up to a whole step, at places that depend on the CPU's kernels (lab/baseline.py).
TOL = {torch.float64: 1e-10}


def _local(batch, dp_rank, dp_size):
    return tuple(t.chunk(dp_size)[dp_rank] for t in batch)


def _train(ddp, dp_rank, dp_size, batches, micro=1, profile=False, driven=None):
    """Train with `ddp`; per step: all-reduce calls/bytes/wire bytes, calls inside no_sync, and (last
    step, if asked) the profiled spans of backward and the all-reduces. driven: the module called directly,
    as train.py and a pipeline do — "last" (sync_next_backward before each backward: only the last syncs)
    or "after" (no backward syncs; synchronize() afterwards, then once more, which must send nothing)."""
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    steps = []
    for i, batch in enumerate(batches):
        x, y = _local(batch, dp_rank, dp_size)
        xs, ys = x.chunk(micro), y.chunk(micro)
        quiet = 0
        for m in range(micro - 1):
            with CommCounter() as c:
                if driven:
                    ddp.sync_next_backward(False)
                    loss = ddp.module(xs[m], ys[m]) / micro
                else:
                    with ddp.no_sync():  # as with PyTorch's DDP, the forward decides (backward may be outside)
                        loss = ddp(xs[m], ys[m]) / micro
                loss.backward()
                if isinstance(ddp, NaiveDDP):
                    ddp.all_reduce_gradients()
            quiet += c.calls()
        if driven:
            ddp.sync_next_backward(driven == "last")
        loss = (ddp.module if driven else ddp)(xs[-1], ys[-1]) / micro
        prof = ProfileSpans() if profile and i == len(batches) - 1 else None
        with CommCounter() as c, prof or contextlib.nullcontext():
            loss.backward()
            if isinstance(ddp, NaiveDDP):
                ddp.all_reduce_gradients()
            if driven == "after":
                ddp.synchronize()
        if driven:
            with CommCounter() as again:
                ddp.synchronize()  # nothing left: a no-op
            quiet += again.calls()
        steps.append(dict(calls=c.calls("all_reduce"), other=c.calls() - c.calls("all_reduce"),
                          bytes=c.bytes("all_reduce"), wire=c.wire_bytes("all_reduce"), quiet=quiet,
                          spans=prof.spans if prof else None))
        opt.step()
        opt.zero_grad(set_to_none=len(steps) % 2 == 0)  # both ways: views kept, and views rebuilt
    return dict(params=snapshot(ddp.module), steps=steps)


# ---- a parameter no rank used (issue 12, item 4) ----------------------------------------------

V, D, U_STEPS, U_BATCH = 11, 8, 4, 8


class Branchy(nn.Module):
    """A branch that rank (step mod P) takes, a gate only rank 0 uses on even steps (so on odd steps
    no rank uses it), and a parameter no rank ever uses."""

    def __init__(self, seed):
        torch.manual_seed(seed)
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
        self.branch, self.gate = nn.Linear(D, D), nn.Linear(D, D, bias=False)
        self.never = nn.Parameter(torch.randn(D))
        self.double()

    def forward(self, x, y, rank, step, P):
        h = torch.tanh(self.body(self.emb(x)))
        if rank == step % P:
            h = h + self.branch(h)
        if rank == 0 and step % 2 == 0:
            h = h * torch.sigmoid(self.gate(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def branchy_batches(P):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, V, (U_BATCH, 6), generator=g), torch.randint(0, V, (U_BATCH, 6), generator=g), step)
            for step in range(U_STEPS)]


def branchy_reference(P, weight_decay):
    def loss_fn(model, batch):  # the mean over ranks of each rank's loss on its rows
        x, y, step = batch
        return sum(model(*_local((x, y), r, P), r, step, P) for r in range(P)) / P
    return single_process(Branchy(0), branchy_batches(P), lr=LR, weight_decay=weight_decay, keep_grads=True,
                          loss_fn=loss_fn)


def _unused():
    """Every wrapper, weight decay on and off: per-step gradients (None where none) and final parameters."""
    rank, P, out = dist.get_rank(), dist.get_world_size(), {}
    for wd in (0.0, 0.1):
        for name in ("naive", "one", "many", "torch"):
            if name == "torch":
                ddp = references.ddp(Branchy(rank), None, find_unused_parameters=True)
            elif name == "naive":
                ddp = NaiveDDP(Branchy(rank))
            else:
                ddp = BucketedDDP(Branchy(rank), None, *((25, 25) if name == "one" else (0, 0)))
            opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=wd)
            grads = []
            for x, y, step in branchy_batches(P):
                ddp(*_local((x, y), rank, P), rank, step, P).backward()
                if name == "naive":
                    ddp.all_reduce_gradients()
                grads.append(snapshot(ddp.module, grads=True))
                opt.step()
                opt.zero_grad()  # set_to_none=True, as the single-process run does
            out[wd, name] = dict(grads=grads, params=snapshot(ddp.module))
    return out


# ---- bad input, reentrant checkpointing ---------------------------------------------------------

def _bad_input(group):
    """Every bad argument raises ValueError on every rank before any collective."""
    errors = []
    with CommCounter() as c:
        for kw in (dict(bucket_cap_mb=-1), dict(first_bucket_mb="big"), dict(compute_dtype=torch.int32),
                   dict(reduce_dtype="fp32")):
            try:
                BucketedDDP(build_model("tiny"), group, **kw)
            except ValueError as e:
                errors.append(str(e))
        for module, g in ((build_model("tiny"), "dp"), (build_model("tiny").requires_grad_(False), group)):
            try:
                NaiveDDP(module, g)
            except ValueError as e:
                errors.append(str(e))
    return errors, c.calls()


class _Reentrant(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block, self.mlp = block, block.mlp  # the model looks for layer.mlp

    def forward(self, h, cos, sin):
        return torch.utils.checkpoint.checkpoint(self.block, h, cos, sin, use_reentrant=True)


def _reentrant(rank, P, batch):
    """Reentrant checkpointing runs a backward inside the backward: a clear error, no collective."""
    model = build_model("tiny", seed=rank)
    model.layers[0] = _Reentrant(model.layers[0])
    ddp = BucketedDDP(model, None, 25, 25)
    with CommCounter() as c:
        try:
            ddp(*_local(batch, rank, P)).backward()
        except RuntimeError as e:
            return str(e), c.calls()
    return None, c.calls()


# ---- one spawned group per world size runs everything -------------------------------------------

def _suite(dtype):
    rank, P = dist.get_rank(), dist.get_world_size()
    batches = global_batches(STEPS, B, S)
    out = {}
    # The group from a Mesh; each rank starts from its own seed, so only the broadcast makes them equal.
    mesh = Mesh(dp_shard=P)
    for name, (cap, first) in caps(dtype).items():
        ddp = BucketedDDP(build_model("tiny", seed=rank, dtype=dtype), mesh, cap, first)
        out[name] = _train(ddp, rank, P, batches, profile=name == "many")
        out[name]["buckets"] = [b.nbytes for b in ddp.buckets]
        out[name]["bucket_params"] = [[ddp.names[p] for p in b.params] for b in ddp.buckets]
    out["naive"] = _train(NaiveDDP(build_model("tiny", seed=rank, dtype=dtype), dist.group.WORLD), rank, P,
                          batches, profile=True)

    torch_ddp = references.ddp(build_model("tiny", seed=rank, dtype=dtype), None)
    opt = torch.optim.AdamW(torch_ddp.parameters(), lr=LR)
    for batch in batches:
        torch_ddp(*_local(batch, rank, P)).backward()
        opt.step()
        opt.zero_grad()
    out["torch"] = snapshot(torch_ddp.module)

    # no_sync: K micro-batches of the K-times bigger batch per optimizer step
    big = global_batches(2, K * B, S)
    out["no_sync"] = _train(BucketedDDP(build_model("tiny", seed=rank, dtype=dtype), None, *caps(dtype)["two"]),
                            rank, P, big, micro=K)
    out["no_sync_naive"] = _train(NaiveDDP(build_model("tiny", seed=rank, dtype=dtype)), rank, P, big, micro=K)
    for how in ("last", "after"):  # the same, driven from outside the wrapper (train.py, a pipeline)
        out[f"driven_{how}"] = _train(BucketedDDP(build_model("tiny", seed=rank, dtype=dtype), None,
                                                  *caps(dtype)["two"]), rank, P, big, micro=K, driven=how)

    # Mixed precision: bf16 compute, gradients reduced in fp32 (default) or in bf16; and this rank's own gradient,
    # from a plain model under the same autocast in this process (the same kernels: the same bits), to check against
    plain = build_model("tiny", seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = plain(*_local(batches[0], rank, P))
    loss.backward()
    out["bf16_local"] = snapshot(plain, grads=True)
    for name, rd in (("bf16_fp32", None), ("bf16_bf16", torch.bfloat16)):
        ddp = BucketedDDP(build_model("tiny", seed=rank), None, compute_dtype=torch.bfloat16, reduce_dtype=rd)
        with CommCounter() as c:
            ddp(*_local(batches[0], rank, P)).backward()
        out[name] = dict(grads=snapshot(ddp.module, grads=True), bytes=c.bytes("all_reduce"),
                         calls=c.calls("all_reduce"), grad_dtypes={p.grad.dtype for p in ddp.module.parameters()})

    # A dp sub-group: on 4 ranks, Mesh(dp_shard=2, tp=2) gives dp groups {0, 2} and {1, 3}
    if P == 4:
        sub = Mesh(dp_shard=2, tp=2)
        ddp = BucketedDDP(build_model("tiny", seed=rank, dtype=dtype), sub, *caps(dtype)["two"])
        out["subgroup"] = _train(ddp, sub.rank("dp"), sub.size("dp"), batches)
        out["subgroup"]["src"] = sub.ranks("dp")[0]
    out["unused"] = _unused()
    out["bad"] = _bad_input(dist.group.WORLD)
    out["reentrant"] = _reentrant(rank, P, batches[0])
    return out


@pytest.fixture(scope="module", params=[(2, torch.float64), (4, torch.float64)], ids=["P2-fp64", "P4-fp64"])
def run(request):
    P, dtype = request.param
    return P, dtype, run_ranks(_suite, P, dtype, timeout=240)


def _ref(dtype, steps=STEPS, batch=B, seed=0):
    return snapshot(single_process(reference_model("tiny", seed=seed, dtype=dtype),
                                   global_batches(steps, batch, S), lr=LR)["model"])


def _close(a, b, dtype):
    assert max_diff(a, b) <= TOL[dtype]


def test_matches_single_process_for_one_two_and_many_buckets(run):
    P, dtype, results = run
    ref, gb = _ref(dtype), grad_bytes(dtype)
    for name in ("one", "two", "many"):
        n_buckets = {"one": 1, "two": 2, "many": N_PARAMS}[name]
        for r in results:
            assert len(r[name]["buckets"]) == n_buckets
            assert sum(r[name]["buckets"]) == gb
            _close(r[name]["params"], ref, dtype)
            for st in r[name]["steps"]:
                # one all-reduce per bucket and one of the used flags; the gradient once, plus a byte per
                # parameter tensor; a ring sends 2(P-1)/P of it all
                assert st["calls"] == n_buckets + 1 and st["other"] == 0
                assert st["bytes"] == gb + FLAGS
                assert st["wire"] == pytest.approx(2 * (P - 1) / P * (gb + FLAGS))
    # Buckets fill in reverse parameter order: the first holds the output layer
    names = [n for n, _ in reference_model("tiny").named_parameters()]
    for rank, r in enumerate(results):  # every rank builds its own buckets: all must agree on the layout
        two = r["two"]["bucket_params"]
        assert two[0][0] == "output.weight" and [n for b in two for n in b] == names[::-1], rank


def test_naive_matches_single_process_and_does_not_overlap(run):
    P, dtype, results = run
    ref = _ref(dtype)
    for r in results:
        _close(r["naive"]["params"], ref, dtype)
        for st in r["naive"]["steps"]:
            assert st["calls"] == N_PARAMS + 1 and st["bytes"] == grad_bytes(dtype) + FLAGS
        spans = r["naive"]["steps"][-1]["spans"]  # the profiler saw every all-reduce, after backward
        assert len([s for s in spans if s["name"] == "all_reduce"]) == N_PARAMS + 1, _timeline(spans)
        assert overlap_fraction(spans) == 0.0, _timeline(spans)
        # With one bucket per parameter, all-reduces start while backward still runs.
        spans = r["many"]["steps"][-1]["spans"]
        bwd = next(s for s in spans if s["name"] == "backward")
        assert min(s["start"] for s in spans if s["name"] == "all_reduce") < bwd["end"], _timeline(spans)
        assert overlap_fraction(spans) > 0, _timeline(spans)


def _timeline(spans):
    t0 = min(s["start"] for s in spans)
    return "\n".join(f"{s['name']:10s} {1e3 * (s['start'] - t0):8.3f} {1e3 * (s['end'] - t0):8.3f} ms {s['bytes']}"
                     for s in spans)


def test_matches_pytorch_ddp(run):
    P, dtype, results = run
    for r in results:
        _close(r["two"]["params"], r["torch"], dtype)
        _close(r["naive"]["params"], r["torch"], dtype)


def test_no_sync_accumulation_equals_one_big_step(run):
    P, dtype, results = run
    ref = _ref(dtype, steps=2, batch=K * B)
    for r in results:
        for name in ("no_sync", "no_sync_naive", "driven_last", "driven_after"):
            _close(r[name]["params"], ref, dtype)
            for st in r[name]["steps"]:
                assert st["quiet"] == 0  # nothing sent on the micro-steps inside no_sync
                assert st["calls"] == (N_PARAMS if name == "no_sync_naive" else 2) + 1
                assert st["bytes"] == grad_bytes(dtype) + FLAGS


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_a_parameter_no_rank_used_gets_no_gradient(run, weight_decay):
    """float64, one process vs every wrapper and PyTorch's DDP(find_unused_parameters=True): a branch a
    different rank takes each step gets the average; a gate no rank uses on odd steps, and a parameter
    no rank ever uses, end those steps with grad None — so AdamW neither moves them nor counts a step."""
    P, _, results = run
    ref = branchy_reference(P, weight_decay)
    for rank, r in enumerate(results):
        for name in ("naive", "one", "many", "torch"):
            got = r["unused"][weight_decay, name]
            for step, (g, want) in enumerate(zip(got["grads"], ref["grads"])):
                nobody = {k for k, v in want.items() if v is None}
                assert {k for k, v in g.items() if v is None} == nobody, \
                    f"{name}, rank {rank}, step {step}: grad None should be exactly {sorted(nobody)}"
                assert max_diff(g, want) <= 1e-12, f"{name}, rank {rank}, step {step}"
            assert max_diff(got["params"], ref["model"]) <= 1e-12, \
                f"{name}, rank {rank}: AdamW moved a parameter no rank used"
    assert {k for k, v in ref["grads"][1].items() if v is None} == {"gate.weight", "never"}  # the test bites


def test_mixed_precision_reduces_in_the_chosen_dtype(run):
    """bf16 autocast: the averaged gradient is the mean of the ranks' own bf16-computed gradients (g_r, each from
    a plain model in its own process: the same kernels, the same bits) up to the rounding of the reduction: a cast
    to the reduce dtype, P - 1 additions and a division, each within u = 2^-8 (bf16) or 2^-24 (fp32) of what it
    rounds, so |ours - mean| <= (P + 1)·u·(1 + u)^P·Σ_r|g_r| / P elementwise — whatever the CPU's kernels.
    (Against one process on the global batch bf16 differs more, by rounding activations over B/P rows instead of B; the
    float64 tests prove the mean of the ranks' gradients is that one.)"""
    P, dtype, results = run
    mean = {k: sum(r["bf16_local"][k] for r in results) / P for k in results[0]["bf16_local"]}
    total = {k: sum(r["bf16_local"][k].abs() for r in results) for k in mean}
    for r in results:
        assert r["bf16_fp32"]["bytes"] == grad_bytes(torch.float32) + FLAGS and r["bf16_fp32"]["calls"] == 2
        assert r["bf16_bf16"]["bytes"] == grad_bytes(torch.bfloat16) + FLAGS and r["bf16_bf16"]["calls"] == 2
        for name, u in (("bf16_fp32", 2.0 ** -24), ("bf16_bf16", 2.0 ** -8)):
            assert r[name]["grad_dtypes"] == {torch.float32}
            for k, g in r[name]["grads"].items():
                excess = (g - mean[k]).abs() - (P + 1) * u * (1 + u) ** P * total[k] / P
                assert excess.max().item() <= 0, (name, k, excess.max().item())
        assert max_diff(r["bf16_fp32"]["grads"], r["bf16_bf16"]["grads"]) > 0  # the bf16 reduction really rounds


def test_dp_subgroup_of_a_mesh(run):
    P, dtype, results = run
    if P != 4:
        assert all("subgroup" not in r for r in results)
        return
    for src in (0, 1):  # group {0, 2} starts from rank 0's seed, {1, 3} from rank 1's
        ref = _ref(dtype, seed=src)
        for r in results:
            if r["subgroup"]["src"] == src:
                _close(r["subgroup"]["params"], ref, dtype)
                want = grad_bytes(dtype) + FLAGS  # 2(2-1)/2 = 1x on a group of two
                assert all(st["wire"] == pytest.approx(want) for st in r["subgroup"]["steps"])


def test_bad_input_raises_on_every_rank_before_any_collective(run):
    P, dtype, results = run
    for r in results:
        errors, calls = r["bad"]
        assert calls == 0 and len(errors) == 6
        assert "bucket_cap_mb" in errors[0] and "first_bucket_mb" in errors[1]
        assert "compute_dtype" in errors[2] and "reduce_dtype" in errors[3]
        assert "Mesh" in errors[4] and "requires_grad" in errors[5]


def test_reentrant_checkpoint_is_a_clear_error(run):
    P, dtype, results = run
    for r in results:
        msg, calls = r["reentrant"]
        assert msg is not None and "use_reentrant=False" in msg and "layers.0" in msg
        assert calls == 0


def test_overlap_fraction():
    spans = [dict(name="backward", start=0.0, end=1.0),
             dict(name="all_reduce", start=0.5, end=1.5), dict(name="all_reduce", start=0.8, end=1.1)]
    assert overlap_fraction(spans) == pytest.approx(0.5)  # union 0.5..1.5, half inside backward
    assert overlap_fraction(spans[:1]) == 0.0


def test_torchrun_demo():
    out = run_script("ddp.py", "--model", "tiny", "--steps", "2", "--seq", "16", "--bucket-mb", "0.05", nproc=2)
    assert "all three match the single-process run" in out and "throughput" in out
    assert len(_rows(out)) == 6  # three versions on each of two ranks


def test_single_process_demo_and_bad_arguments():
    assert "all three match the single-process run" in run_script("ddp.py", "--model", "tiny", "--steps", "1", "--seq", "16")
    out = run_script("ddp.py", "--model", "tiny", "--batch", "3", nproc=2, expect_fail=True)
    assert out.count("error: --batch 3 must be a multiple of the world size 2") == 2  # one line per rank


# ---- the README's exercises ----------------------------------------------------------------------

def _rows(out):
    """{(rank, version): dict(calls, mib, ring, first, overlap)} from the demo's table (first: None = after backward)."""
    rows = {}
    for m in re.finditer(r"^(\d+)\s+(naive|bucketed [\d.]+ MiB|PyTorch DDP)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)"
                         r"\s+(\d+%|after)\s+(\d+)%", out, flags=re.M):
        rows[int(m[1]), m[2].split()[0]] = dict(calls=int(m[4]), mib=float(m[5]), ring=float(m[6]),
                                                first=None if m[7] == "after" else int(m[7][:-1]), overlap=int(m[8]))
    return rows


def _check_per_parameter(out):
    rows = _rows(out)
    for rank in (0, 1):  # one bucket per parameter: as many calls as naive, the same bytes, an early start
        assert rows[rank, "bucketed"]["calls"] == rows[rank, "naive"]["calls"] == N_PARAMS + 1
        assert rows[rank, "bucketed"]["mib"] == rows[rank, "naive"]["mib"]
        assert rows[rank, "naive"]["first"] is None and rows[rank, "naive"]["overlap"] == 0
        assert rows[rank, "bucketed"]["first"] <= 50
    assert max(rows[r, "bucketed"]["overlap"] for r in (0, 1)) > 0


def _check_one_bucket(out):
    rows = _rows(out)
    for rank in (0, 1):  # one bucket: two calls (it and the used flags); it starts only as backward ends
        assert rows[rank, "bucketed"]["calls"] == 2
        assert rows[rank, "bucketed"]["first"] is None or rows[rank, "bucketed"]["first"] >= 75  # None: after it


def _check_ring(out):
    for row in _rows(out).values():  # at P = 4 a ring sends 2(P-1)/P = 1.5x what is handed to all-reduce
        assert row["ring"] == pytest.approx(1.5 * row["mib"], abs=2e-3)
    assert len({row["mib"] for row in _rows(out).values()}) == 1  # every version sends the same bytes


def _check_no_agreement(out):
    # Rank 1 never takes the branch: deciding alone, it drops the gradient (None) that rank 0 steps with.
    assert re.search(r"unused_some, (one_bucket|bucket_per_param), rank 1, step 0: grad None should be exactly \[\]", out)
    assert "1 failed, 1 passed" in out  # unused_all still passes: there every rank alone reaches the same verdict


NO_AGREEMENT = ("ddp.py", "used = dict(zip(self.params, self._agree_on_used()))",
                "used = {p: p.grad is not None for p in self.params}")
EXERCISES = [
    Exercise("torchrun --nproc_per_node 2 ddp.py --model tiny --steps 3 --bucket-mb 0", _check_per_parameter,
             alone=True),
    Exercise("torchrun --nproc_per_node 2 ddp.py --model tiny --steps 3 --bucket-mb 100 --first-bucket-mb 100",
             _check_one_bucket, alone=True),
    Exercise("torchrun --nproc_per_node 4 ddp.py --model tiny --steps 3", _check_ring),
    Exercise("python -m pytest -q tests/test_awkward_ddp.py -k P2-unused", _check_no_agreement, edits=(NO_AGREEMENT,),
             fails=True),
]


# ---- the core (ddp.py section 1): average_gradients, data parallel in its plainest form --------------------

def _average_gradients_run(steps=STEPS):
    """The float64 tiny model trained on this rank's rows with average_gradients after each backward: the
    parameters after the steps on this rank, and the last step's collectives."""
    from ddp import average_gradients
    from lab.data import get_batch, load_corpus
    tokens, r, P = load_corpus(), dist.get_rank(), dist.get_world_size()
    model = build_model("tiny", seed=0, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in range(steps):
        model(*get_batch(tokens, s, B, S, 0, r, P)).backward()
        with CommCounter() as comm:
            average_gradients(model.parameters())
        opt.step()
        opt.zero_grad()
    return dict(state=snapshot(model), calls=comm.calls("all_reduce"), bytes=comm.bytes("all_reduce"))


@pytest.mark.parametrize("P", [1, 2, 4])
def test_average_gradients_equals_one_process_in_one_all_reduce(P):
    want = single_process(reference_model(dtype=torch.float64), global_batches(STEPS, B, S), lr=LR)["model"]
    for rank, res in enumerate(run_ranks(_average_gradients_run, P, timeout=120)):
        assert max_diff(res["state"], snapshot(want)) < 1e-10, (P, rank, max_diff(res["state"], snapshot(want)))
        assert (res["calls"], res["bytes"]) == (1, NUMEL * 8), (P, rank, res)  # every gradient in ONE call
