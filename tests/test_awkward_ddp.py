"""Awkward models under data parallel (issue 12): each case is trained with NaiveDDP and BucketedDDP
(one bucket for all; one bucket per parameter) on 2 and 4 ranks in float64, and compared with ONE
process (lab.baseline.single_process) on the same global batches: every step's gradients (None exactly where
one process has None) and the final parameters, to 1e-12.

    tied            the output head IS the embedding's weight (one Parameter, two uses)
    frozen          a layer with requires_grad=False (never sent, never changed)
    unused_some     a branch that only rank 0 takes (the others contribute zeros)
    unused_all      a parameter no rank uses, under weight decay (grad None: AdamW must not touch it)
    used_twice      one Linear applied twice in one forward
    eval_mid        a no_grad forward between backward and the optimizer step
    eval_between    a no_grad forward between steps (its loss is one process's loss of the next step)
    two_forwards    two forwards, one backward of their mean
    two_backwards   two forward/backward pairs before one step
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp import BucketedDDP, NaiveDDP
from lab.baseline import max_diff, single_process, snapshot
from harness import run_ranks

V, D, STEPS, BATCH, SEQ, LR, WD = 13, 8, 3, 8, 5, 1e-2, 0.1
CASES = ("tied", "frozen", "unused_some", "unused_all", "used_twice", "eval_mid", "eval_between",
         "two_forwards", "two_backwards")
WRAPPERS = {"naive": None, "one_bucket": (25, 25), "bucket_per_param": (0, 0)}
TOL = 1e-12


class Net(nn.Module):
    def __init__(self, seed, case):
        torch.manual_seed(seed)
        super().__init__()
        self.case = case
        self.emb, self.mid, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V, bias=False)
        if case == "tied":
            self.head.weight = self.emb.weight  # [V, D] both: one Parameter, used twice
        if case == "frozen":
            self.mid.requires_grad_(False)
        if case == "unused_some":
            self.branch = nn.Linear(D, D)
        if case == "unused_all":
            self.never = nn.Parameter(torch.randn(D))
        self.double()

    def forward(self, x, y, rank=0):
        h = torch.tanh(self.mid(self.emb(x)))
        if self.case == "used_twice":
            h = torch.tanh(self.mid(h))
        if self.case == "unused_some" and rank == 0:
            h = h + self.branch(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _local(t, rank, P):
    return t.chunk(P)[rank]


def rank_losses(model, x, y, rank, case):
    """The losses one rank backwards in one step, one at a time (a generator: the caller runs backward
    on each before the next forward)."""
    if case == "two_forwards":
        (xa, xb), (ya, yb) = x.chunk(2), y.chunk(2)
        yield (model(xa, ya, rank) + model(xb, yb, rank)) / 2
    elif case == "two_backwards":
        (xa, xb), (ya, yb) = x.chunk(2), y.chunk(2)
        yield model(xa, ya, rank) / 2
        yield model(xb, yb, rank) / 2
    else:
        yield model(x, y, rank)


def batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, V, (BATCH, SEQ), generator=g), torch.randint(0, V, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def reference(case, P, steps=STEPS):
    """One process on the first `steps` global batches: the loss is the mean over ranks of each rank's loss
    on its rows (each part of a two-backward step backwarded in turn)."""
    def loss_fn(model, batch):
        x, y = batch
        total = None
        for parts in zip(*(rank_losses(model, _local(x, r, P), _local(y, r, P), r, case) for r in range(P))):
            if total is not None:
                total.backward()
            total = sum(parts) / P
        return total
    return single_process(Net(0, case), batches()[:steps], lr=LR, weight_decay=WD, keep_grads=True, loss_fn=loss_fn)


def reference_evals(P):
    """[rank][i]: one process's loss on rank r's rows of global batch i + 1, with the weights after i + 1
    steps: what each rank's eval_between forward must give."""
    data, out = batches(), [[] for _ in range(P)]
    for steps in range(1, STEPS):
        model = reference("eval_between", P, steps)["model"]
        x, y = data[steps]
        with torch.no_grad():
            for r in range(P):
                out[r].append(model(_local(x, r, P), _local(y, r, P), r).item())
    return out


def _train(case, wrapper, rank, P):
    net = Net(rank, case)  # each rank its own initialisation: the wrapper's broadcast makes them equal
    ddp = NaiveDDP(net) if wrapper == "naive" else BucketedDDP(net, None, *WRAPPERS[wrapper])
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WD)
    out = dict(grads=[], evals=[])
    data = batches()
    for step, (x, y) in enumerate(data):
        x, y = _local(x, rank, P), _local(y, rank, P)
        for loss in rank_losses(ddp, x, y, rank, case):
            loss.backward()
        if case == "eval_mid":
            with torch.no_grad():
                ddp(x, y, rank)
        if wrapper == "naive":
            ddp.all_reduce_gradients()
        out["grads"].append(snapshot(net, grads=True))
        opt.step()
        opt.zero_grad()
        if case == "eval_between" and step + 1 < len(data):
            with torch.no_grad():  # the next step's rows, with the weights just stepped
                nx, ny = data[step + 1]
                out["evals"].append(ddp(_local(nx, rank, P), _local(ny, rank, P), rank).item())
    out["params"] = snapshot(net)
    return out


def _all_cases():
    rank, P = dist.get_rank(), dist.get_world_size()
    return {(case, w): _train(case, w, rank, P) for case in CASES for w in WRAPPERS}


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def run(request):
    return request.param, run_ranks(_all_cases, request.param, timeout=240)


def differences(case, P, results) -> dict:
    """{wrapper: largest |difference| to one process over every rank, step gradient and final parameter}."""
    ref = reference(case, P)
    out = {}
    for w in WRAPPERS:
        worst = 0.0
        for rank, r in enumerate(results):
            got = r[case, w]
            for step, (g, want) in enumerate(zip(got["grads"], ref["grads"])):
                nobody = sorted(k for k, v in want.items() if v is None)
                assert sorted(k for k, v in g.items() if v is None) == nobody, \
                    f"{case}, {w}, rank {rank}, step {step}: grad None should be exactly {nobody}"
                worst = max(worst, max_diff(g, want))
            worst = max(worst, max_diff(got["params"], ref["model"]))
        if case == "eval_between":  # the ranks' mean eval loss is one process's loss at the next step
            evals = [sum(r[case, w]["evals"][i] for r in results) / P for i in range(STEPS - 1)]
            worst = max(worst, max(abs(a - b) for a, b in zip(evals, ref["losses"][1:])))
            for rank, (r, want) in enumerate(zip(results, reference_evals(P))):  # and each rank's, on its rows
                assert len(r[case, w]["evals"]) == len(want), (w, rank)
                worst = max(worst, max(abs(a - b) for a, b in zip(r[case, w]["evals"], want)))
        out[w] = worst
    return out


@pytest.mark.parametrize("case", CASES)
def test_equals_one_process(run, case):
    P, results = run
    diffs = differences(case, P, results)
    assert max(diffs.values()) <= TOL, f"{case} at P={P}: {diffs}"


def test_the_cases_are_awkward():
    """Each case really has what it claims (in one process), so none of the tests above is vacuous."""
    tied, frozen = Net(0, "tied"), Net(0, "frozen")
    assert tied.head.weight is tied.emb.weight and len(list(tied.parameters())) == 3  # emb (= head), mid
    assert not frozen.mid.weight.requires_grad
    ref = reference("unused_all", 2)
    assert all(g["never"] is None for g in ref["grads"])
    assert torch.equal(ref["model"].never, Net(0, "unused_all").never)  # AdamW left it alone
    some = reference("unused_some", 2)
    assert all(g["branch.weight"] is not None for g in some["grads"])
