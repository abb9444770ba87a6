"""Data parallel (ddp.py) equals one process on the global batch, at 2 and 4 ranks.

All configurations run inside one spawned group per world size (spawning costs seconds);
the ranks return what they measured and the tests compare it with a single-process run.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint

from ddp import MiB, BucketedDDP, NaiveDDP, overlap_fraction
from harness import global_batches, reference_model, run_ranks, run_script, train_reference
from instruments import CommCounter
from mesh import Mesh
from model import build_model

STEPS, B, S, LR = 3, 8, 16, 1e-3
K = 2  # micro-batches for no_sync
N_PARAMS = len(list(reference_model("tiny").parameters()))
NUMEL = sum(p.numel() for p in reference_model("tiny").parameters())
GRAD_BYTES = 4 * NUMEL  # fp32


def grad_bytes(dtype):
    return NUMEL * torch.empty((), dtype=dtype).element_size()


def caps(dtype):
    """(bucket_cap_mb, first_bucket_mb) giving exactly one bucket (the whole model), two, one per parameter."""
    return {"one": (25, 25), "two": (0.6 * grad_bytes(dtype) / MiB,) * 2, "many": (0, 0)}

# Both world sizes in fp32 would do; the 4-rank run is in float64, where "equal" can mean 1e-10:
# Adam divides by sqrt(v), so fp32 rounding in near-zero gradients shows up as ~1e-6 in parameters.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10)}


class Awkward(nn.Module):
    """Tied embedding/output weight, a frozen norm, a branch only some ranks take, a parameter no one uses."""

    def __init__(self, seed, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.body = build_model("tiny", seed=seed, dtype=dtype)
        self.body.output.weight = self.body.tok_embeddings.weight
        self.body.layers[0].attn_norm.weight.requires_grad_(False)
        self.branch = nn.Linear(32, 32, bias=False)
        self.unused = nn.Parameter(torch.randn(5))
        self.to(dtype)

    def forward(self, x, y, take_branch):
        loss = self.body(x, y)
        if take_branch:
            loss = loss + self.branch(self.body.tok_embeddings(x)).pow(2).mean()
        return loss


def _local(batch, dp_rank, dp_size):
    x, y = batch
    n = x.shape[0] // dp_size
    return x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _grads(module):
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in module.named_parameters()}


def _train(ddp, dp_rank, dp_size, batches, micro=1):
    """Train with `ddp`; per step: all-reduce calls/bytes/wire bytes, calls inside no_sync, timeline."""
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    steps = []
    for batch in batches:
        x, y = _local(batch, dp_rank, dp_size)
        xs, ys = x.chunk(micro), y.chunk(micro)
        ddp.timeline.spans.clear()
        quiet = 0
        for m in range(micro - 1):
            with CommCounter() as c:
                with ddp.no_sync():  # as with PyTorch's DDP, the forward decides (backward may be outside)
                    loss = ddp(xs[m], ys[m]) / micro
                loss.backward()
                if isinstance(ddp, NaiveDDP):
                    ddp.all_reduce_gradients()
            quiet += c.calls()
        with CommCounter() as c:
            (ddp(xs[-1], ys[-1]) / micro).backward()
            if isinstance(ddp, NaiveDDP):
                ddp.all_reduce_gradients()
        steps.append(dict(calls=c.calls("all_reduce"), other=c.calls() - c.calls("all_reduce"),
                          bytes=c.bytes("all_reduce"), wire=c.wire_bytes("all_reduce"), quiet=quiet,
                          spans=list(ddp.timeline.spans)))
        opt.step()
        opt.zero_grad(set_to_none=len(steps) % 2 == 0)  # both ways: views kept, and views rebuilt
    return dict(params=_params(ddp.module), steps=steps)


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
        try:
            NaiveDDP(build_model("tiny"), "dp")
        except ValueError as e:
            errors.append(str(e))
        frozen = build_model("tiny").requires_grad_(False)
        try:
            NaiveDDP(frozen, group)
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


def _suite(dtype):
    rank, P = dist.get_rank(), dist.get_world_size()
    batches = global_batches(STEPS, B, S)
    out = {}
    # The group from a Mesh; each rank starts from its own seed, so only the broadcast makes them equal.
    mesh = Mesh(dp_shard=P)
    CAPS = caps(dtype)
    for name, (cap, first) in CAPS.items():
        ddp = BucketedDDP(build_model("tiny", seed=rank, dtype=dtype), mesh, cap, first)
        out[name] = _train(ddp, rank, P, batches)
        out[name]["buckets"] = [b.nbytes for b in ddp.buckets]
        out[name]["bucket_params"] = [[ddp.names[p] for p in b.params] for b in ddp.buckets]
    out["naive"] = _train(NaiveDDP(build_model("tiny", seed=rank, dtype=dtype), dist.group.WORLD), rank, P, batches)

    torch_ddp = nn.parallel.DistributedDataParallel(build_model("tiny", seed=rank, dtype=dtype))
    opt = torch.optim.AdamW(torch_ddp.parameters(), lr=LR)
    for batch in batches:
        torch_ddp(*_local(batch, rank, P)).backward()
        opt.step()
        opt.zero_grad()
    out["torch"] = _params(torch_ddp.module)

    # no_sync: K micro-batches of the K-times bigger batch per optimizer step
    big = global_batches(2, K * B, S)
    out["no_sync"] = _train(BucketedDDP(build_model("tiny", seed=rank, dtype=dtype), None, *CAPS["two"]), rank, P, big, micro=K)
    out["no_sync_naive"] = _train(NaiveDDP(build_model("tiny", seed=rank, dtype=dtype)), rank, P, big, micro=K)

    # Awkward modules, with one bucket per parameter and with one bucket for all
    for name, (cap, first) in (("awkward_many", CAPS["many"]), ("awkward_one", CAPS["one"])):
        ddp = BucketedDDP(Awkward(seed=rank, dtype=dtype), None, cap, first)
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.0)
        grads = None
        for batch in batches[:2]:
            ddp(*_local(batch, rank, P), take_branch=rank == 0).backward()
            grads = grads or _grads(ddp.module)
            opt.step()
            opt.zero_grad()
        out[name] = dict(grads=grads, params=_params(ddp.module), n_bucketed=sum(len(b.params) for b in ddp.buckets),
                         frozen_grad=ddp.module.body.layers[0].attn_norm.weight.grad)

    # Mixed precision: bf16 compute, gradients reduced in fp32 (default) or in bf16
    for name, rd in (("bf16_fp32", None), ("bf16_bf16", torch.bfloat16)):
        ddp = BucketedDDP(build_model("tiny", seed=rank), None, compute_dtype=torch.bfloat16, reduce_dtype=rd)
        with CommCounter() as c:
            ddp(*_local(batches[0], rank, P)).backward()
        out[name] = dict(grads=_grads(ddp.module), bytes=c.bytes("all_reduce"), calls=c.calls("all_reduce"),
                         grad_dtypes={p.grad.dtype for p in ddp.module.parameters()})

    # A dp sub-group: on 4 ranks, Mesh(dp_shard=2, tp=2) gives dp groups {0, 2} and {1, 3}
    if P == 4:
        sub = Mesh(dp_shard=2, tp=2)
        ddp = BucketedDDP(build_model("tiny", seed=rank, dtype=dtype), sub, *CAPS["two"])
        out["subgroup"] = _train(ddp, sub.rank("dp"), sub.size("dp"), batches)
        out["subgroup"]["src"] = sub.ranks("dp")[0]
    out["bad"] = _bad_input(dist.group.WORLD)
    out["reentrant"] = _reentrant(rank, P, batches[0])
    return out


def _reference_awkward(P, dtype):
    model = Awkward(seed=0, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    grads = None
    for batch in global_batches(STEPS, B, S)[:2]:
        loss = sum(model(*_local(batch, r, P), take_branch=r == 0) for r in range(P)) / P
        loss.backward()
        grads = grads or _grads(model)
        opt.step()
        opt.zero_grad()
    return grads, _params(model)


def _reference_bf16(P):
    """One process, bf16 autocast, the global batch: the gradients mixed precision should give."""
    model = reference_model("tiny")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(*global_batches(1, B, S)[0])
    loss.backward()
    return _grads(model)


def _close(a, b, dtype):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **TOL[dtype], msg=lambda m: f"{k}: {m}")


@pytest.fixture(scope="module", params=[(2, torch.float32), (4, torch.float64)], ids=["P2-fp32", "P4-fp64"])
def run(request):
    P, dtype = request.param
    return P, dtype, run_ranks(_suite, P, dtype, timeout=240)


def _ref(dtype, steps=STEPS, batch=B, seed=0):
    _, model = train_reference(reference_model("tiny", seed=seed, dtype=dtype), global_batches(steps, batch, S), lr=LR)
    return _params(model)


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
                # one all-reduce per bucket, the whole gradient once, ring traffic 2(P-1)/P of it
                assert st["calls"] == n_buckets and st["other"] == 0
                assert st["bytes"] == gb
                assert st["wire"] == pytest.approx(2 * (P - 1) / P * gb)
                assert len([s for s in st["spans"] if s["name"] == "all_reduce"]) == n_buckets
    # Buckets fill in reverse parameter order: the first holds the output layer
    names = [n for n, _ in reference_model("tiny").named_parameters()]
    two = results[0]["two"]["bucket_params"]
    assert two[0][0] == "output.weight" and [n for b in two for n in b] == names[::-1]


def test_naive_matches_single_process_and_does_not_overlap(run):
    P, dtype, results = run
    ref = _ref(dtype)
    for r in results:
        _close(r["naive"]["params"], ref, dtype)
        for st in r["naive"]["steps"]:
            assert st["calls"] == N_PARAMS and st["bytes"] == grad_bytes(dtype)
            assert overlap_fraction(st["spans"]) == 0.0
        # With one bucket per parameter, the first all-reduce starts while backward still runs.
        for st in r["many"]["steps"]:
            bwd = next(s for s in st["spans"] if s["name"] == "backward")
            first = min(s["start"] for s in st["spans"] if s["name"] == "all_reduce")
            assert bwd["start"] < first < bwd["end"]
            assert overlap_fraction(st["spans"]) > 0


def test_matches_pytorch_ddp(run):
    P, dtype, results = run
    for r in results:
        _close(r["two"]["params"], r["torch"], dtype)
        _close(r["naive"]["params"], r["torch"], dtype)


def test_no_sync_accumulation_equals_one_big_step(run):
    P, dtype, results = run
    ref = _ref(dtype, steps=2, batch=K * B)
    for r in results:
        for name in ("no_sync", "no_sync_naive"):
            _close(r[name]["params"], ref, dtype)
            for st in r[name]["steps"]:
                assert st["quiet"] == 0  # nothing sent on the micro-steps inside no_sync
                assert st["calls"] == (2 if name == "no_sync" else N_PARAMS)
                assert st["bytes"] == grad_bytes(dtype)


def test_tied_frozen_and_unused_parameters(run):
    P, dtype, results = run
    ref_grads, ref_params = _reference_awkward(P, dtype)
    for r in results:
        for name in ("awkward_many", "awkward_one"):
            a = r[name]
            # tied weight counted once, the frozen norm not at all
            assert a["n_bucketed"] == len(ref_params) - 1
            assert a["frozen_grad"] is None
            _close(a["grads"], ref_grads, dtype)
            assert torch.count_nonzero(a["grads"]["unused"]) == 0  # no rank used it: a zero gradient
            assert a["grads"]["branch.weight"].abs().sum() > 0     # only rank 0 used it
            _close(a["params"], ref_params, dtype)


def test_mixed_precision_reduces_in_the_chosen_dtype(run):
    P, dtype, results = run
    ref = _reference_bf16(P)
    for r in results:
        assert r["bf16_fp32"]["bytes"] == GRAD_BYTES and r["bf16_fp32"]["calls"] == 1
        assert r["bf16_bf16"]["bytes"] == GRAD_BYTES // 2 and r["bf16_bf16"]["calls"] == 1
        for name in ("bf16_fp32", "bf16_bf16"):
            assert r[name]["grad_dtypes"] == {torch.float32}
            for k, g in r[name]["grads"].items():
                # bf16 matmuls over B/P rows instead of B: equal to bf16 precision, not bit for bit
                torch.testing.assert_close(g, ref[k], atol=2e-2 * ref[k].abs().max().item() + 1e-6, rtol=0)


def test_dp_subgroup_of_a_mesh(run):
    P, dtype, results = run
    if P != 4:
        assert "subgroup" not in results[0]
        return
    for src in (0, 1):  # group {0, 2} starts from rank 0's seed, {1, 3} from rank 1's
        ref = _ref(dtype, seed=src)
        for r in results:
            if r["subgroup"]["src"] == src:
                _close(r["subgroup"]["params"], ref, dtype)
                gb = grad_bytes(dtype)
                assert all(st["wire"] == pytest.approx(gb) for st in r["subgroup"]["steps"])  # 2(2-1)/2


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


def test_single_process_demo():
    out = run_script("ddp.py", "--model", "tiny", "--steps", "1", "--seq", "16")
    assert "all three match the single-process run" in out
