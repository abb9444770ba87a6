"""Awkward models under ZeRO stages 0-3 and HSDP (fsdp.py, hsdp.py), each against one process in float64.

The models and loops a learner writes every day: tied input/output embeddings, frozen parameters, a
branch that only some ranks take (and, one step, no rank), a parameter no rank ever uses, a block used
twice, evaluation between backward and step, two forwards before one backward, two backwards before
one step, and a load followed by a forward. Every case runs at stages 0, 1, 2, 3 (with and without
reshard_after_forward) and as HSDP, on 2 and 4 ranks, in one spawned group per world size
(tests/test_fsdp.py's `ranks`), and must give the single-process losses, parameters and logits.
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from lab.baseline import max_diff, single_process
from lab.model import Block, build_model, get_config

STEPS, B, S, LR, TOL = 3, 8, 16, 1e-2, 1e-10
CASES = ("tied", "frozen", "branch", "unused", "twice", "eval", "two_forwards", "two_backwards", "load")
CONFIGS = {"stage0": dict(stage=0), "stage1": dict(stage=1), "stage2": dict(stage=2), "stage3": dict(stage=3),
           "stage3_keep": dict(stage=3, reshard_after_forward=False), "hsdp": dict(stage=3, hsdp=True)}


class BranchBlock(Block):
    """A block with an `if`: the rows marked in `self.use` also go through `extra`."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.extra = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.use = None

    def forward(self, h, cos, sin):
        h = super().forward(h, cos, sin)
        if self.use is not None and self.use.any():  # a rank with no marked row never touches extra
            rows = self.use.nonzero().flatten()
            h = h.index_add(0, rows, self.extra(h[rows]))
        return h


def build(case, seed=0):
    """The tiny model in float64 with the case's awkward part."""
    model = build_model("tiny", seed=seed, dtype=torch.float64)
    torch.manual_seed(seed + 7)
    if case == "tied":  # GPT-2's head reuses the embedding
        model.output.weight = model.tok_embeddings.weight
    elif case == "frozen":
        for p in (model.layers[0].attn.wq.weight, model.layers[1].mlp_norm.weight, model.norm.weight):
            p.requires_grad_(False)
    elif case == "branch":
        block = BranchBlock(get_config("tiny")).double()
        block.load_state_dict(model.layers[0].state_dict(), strict=False)
        model.layers[0] = block
    elif case == "unused":
        model.spare = nn.Parameter(torch.randn(7, dtype=torch.float64))  # in the root unit, never used
    elif case == "twice":  # one block applied twice: layers.0 and layers.1 are the same module
        model.layers.insert(1, model.layers[0])
    return model


def batches(case, P):
    """Per step: (x, y, use, x2, y2) global tensors; `use` marks branch rows: step 0 rank 0's rows,
    step 1 no row at all, step 2 the last rank's rows."""
    from lab.data import get_batch, load_corpus
    tokens, out = load_corpus(), []
    for s in range(STEPS):
        use = torch.zeros(B, dtype=torch.bool)
        if case == "branch" and s != 1:
            r = 0 if s == 0 else P - 1
            use[r * B // P:(r + 1) * B // P] = True
        out.append((*get_batch(tokens, s, B, S, 0), use, *get_batch(tokens, s + STEPS, B, S, 0)))
    return out


def loss_fn(case, model, batch):
    x, y, use, x2, y2 = batch
    if case == "branch":
        model.layers[0].use = use
    if case == "two_forwards":
        return (model(x, y) + model(x2, y2)) / 2
    if case == "two_backwards":  # the first backward here, the second by the caller
        (model(x, y) / 2).backward()
        return model(x2, y2) / 2
    return model(x, y)


def eval_tokens():
    return batches("plain", 2)[0][0]  # the whole first global batch, on every rank


def _local(batch, r, P):
    return tuple(t[r * B // P:(r + 1) * B // P] for t in batch)


def run_case(case, config, mesh):
    """One (case, config) on this rank: global losses, full state, logits seen on the way."""
    from fsdp import shard_model
    from hsdp import shard_hybrid
    P, r = dist.get_world_size(), dist.get_rank()
    model, kw = build(case), dict(CONFIGS[config])
    opt = shard_hybrid(model, mesh, lr=LR, **kw) if kw.pop("hsdp", False) else shard_model(model, lr=LR, **kw)
    out, ex = dict(losses=[], evals=[]), eval_tokens()
    for batch in batches(case, P):
        loss = loss_fn(case, model, _local(batch, r, P))
        loss.backward()
        if case == "eval":  # between backward and step: must see the weights of the step before
            with torch.no_grad():
                out["evals"].append(model(ex))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total.item() / P)
    out["state"] = opt.full_state_dict()
    if case == "load":  # gathered by an evaluation first, then overwritten by a load
        with torch.no_grad():
            model(ex)
        sd = build("load", seed=1).state_dict()
        opt.load_full_state_dict(sd)
        with torch.no_grad():
            out["after_load"] = model(ex)
        out["loaded_state"] = opt.full_state_dict()
    return out


def run(cases=CASES, configs=tuple(CONFIGS)):
    """Every case in every configuration on this rank (one spawned group per world size)."""
    from mesh import Mesh
    P = dist.get_world_size()
    mesh = Mesh(dp_replicate=2, dp_shard=P // 2)  # HSDP: 2 replicas of P/2 shards
    return {(c, k): run_case(c, k, mesh) for c in cases for k in configs}


@functools.cache
def reference(case, P):
    """The single-process run on the same global batches (and the logits the eval case must see)."""
    ref = single_process(build(case), batches(case, P), lr=LR, loss_fn=functools.partial(loss_fn, case))
    out = dict(losses=ref["losses"], state=ref["model"].state_dict())
    if case == "eval":  # the weights after s steps, for the evaluation inside step s + 1
        models = [single_process(build(case), batches(case, P)[:s], lr=LR, loss_fn=functools.partial(loss_fn, case))
                  ["model"] for s in range(STEPS)]
        with torch.no_grad():
            out["evals"] = [m(eval_tokens()) for m in models]
    return out


@pytest.fixture(scope="module", params=[2, 4])
def world(request):
    from test_fsdp import ranks
    return request.param, [r["awkward"] for r in ranks(request.param)]


def _diffs(case, P, results):
    ref, out = reference(case, P), {}
    for rank, res in enumerate(results):
        for config in CONFIGS:
            got = res[(case, config)]
            d = max(max_diff(got["state"], ref["state"]), max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])))
            if case == "eval":
                d = max([d] + [(a - b).abs().max().item() for a, b in zip(got["evals"], ref["evals"])])
            out[(rank, config)] = d
    return out


@pytest.mark.parametrize("case", CASES)
def test_awkward_case_equals_one_process(world, case):
    P, results = world
    diffs = _diffs(case, P, results)
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < TOL, f"{case} on {P} ranks: rank {worst[0]} {worst[1]} is {diffs[worst]:.2e} off"
    print(f"{case} P={P}: max |diff| to one process {diffs[worst]:.1e}")


def test_frozen_parameters_round_trip_into_a_plain_model(world):
    P, results = world
    for rank, res in enumerate(results):
        for config in CONFIGS:
            state = res[("frozen", config)]["state"]
            plain = build("plain", seed=3)
            plain.load_state_dict(state, strict=True)  # every name, the frozen ones too
            assert max_diff(plain.state_dict(), state) == 0, (rank, config)
            assert torch.equal(state["norm.weight"], build("frozen").norm.weight), (rank, config)  # frozen: untouched


def test_tied_weight_listed_under_both_names(world):
    P, results = world
    for rank, res in enumerate(results):
        for config in CONFIGS:
            state = res[("tied", config)]["state"]
            assert torch.equal(state["output.weight"], state["tok_embeddings.weight"]), (rank, config)
            assert not torch.equal(state["output.weight"], build("tied").output.weight), (rank, config)  # it moved


def test_a_parameter_no_rank_uses_gets_no_update(world):
    P, results = world
    for rank, res in enumerate(results):
        for config in CONFIGS:
            assert torch.equal(res[("unused", config)]["state"]["spare"], build("unused").spare), (rank, config)


def test_load_refreshes_every_gathered_copy(world):
    P, results = world
    plain = build("load", seed=1)
    with torch.no_grad():
        want = plain(eval_tokens())
    for rank, res in enumerate(results):
        for config in CONFIGS:
            got = res[("load", config)]
            assert max_diff(got["loaded_state"], plain.state_dict()) == 0, (rank, config)
            assert (got["after_load"] - want).abs().max().item() < TOL, (rank, config)


# ---- a module only some ranks run: one clear error on every rank (mesh.agree), never an abort ------------
#
# Ranks pair collectives by order alone. Under ZeRO-3 a unit is gathered before each use, so a module that only
# rank 0 runs makes a gather rank 1 never makes: rank 0's call meets whatever rank 1 does next (a different
# size aborted gloo; an equal size would swap the units' data). fsdp announces every collective first
# (mesh.agree), so both ranks stop at once with the same error, naming what each was about to do.

class RankBranch(nn.Module):
    """The tiny Transformer (`body`) and a small `branch` that only rank 0 runs, on a second call of body's
    embedding: an extra loss a learner computes on one rank."""

    def __init__(self):
        super().__init__()
        self.body = build_model("tiny", seed=0, dtype=torch.float64)
        torch.manual_seed(3)
        self.branch = nn.Linear(self.body.cfg.dim, 1, bias=False).double()

    def forward(self, x, y, rank):
        loss = self.body(x, y)
        return loss + self.branch(self.body.tok_embeddings(x)).pow(2).mean() if rank == 0 else loss


def mismatch_loss(case, model, x, y, rank):
    """The loss of `case` on `rank`'s rows: the model above, or the plain body with a rank-dependent detour."""
    if case == "embedding":
        return model(x, y, rank)
    body, pos = model, torch.arange(x.shape[1])
    h = body.tok_embeddings(x)
    if case == "swapped" and rank == 1:  # blocks of equal size in another order: the silent case without a check
        return body.head(body.blocks(h, [body.layers[1], body.layers[0]], pos), y)
    loss = body.head(body.blocks(h, list(body.layers), pos), y)
    if case == "block" and rank == 0:  # one block run once more, on rank 0 only
        loss = loss + body.blocks(torch.ones_like(h), [body.layers[1]], pos).pow(2).mean()
    return loss


def _mismatch_run(case, stage, units=None, steps=2):
    """(the error's message or None, seconds from the first step to it, full state after the steps)."""
    import time
    from fsdp import shard_model
    from lab.data import get_batch, load_corpus
    r, P = dist.get_rank(), dist.get_world_size()
    model = RankBranch() if case == "embedding" else build_model("tiny", seed=0, dtype=torch.float64)
    units = units(model) if units else None
    opt = shard_model(model, stage, lr=LR, weight_decay=0.0, units=units)
    tokens, start = load_corpus(), time.perf_counter()
    try:
        for s in range(steps):
            x, y = get_batch(tokens, s, B, S, 0, r, P)
            mismatch_loss(case, model, x, y, r).backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        return str(e), time.perf_counter() - start, None
    return None, time.perf_counter() - start, opt.full_state_dict()


def _embedding_in_root(model):
    """units= without the embedding (and the branch): both join the root unit, gathered from forward into
    backward, so rank 0's second call of the embedding needs no collective."""
    return [*model.body.layers, [model.body.norm, model.body.output]]


def run_mismatches():
    out = {(c, 3): _mismatch_run(c, 3) for c in ("embedding", "block", "swapped")}
    out.update({("embedding", s): _mismatch_run("embedding", s) for s in (0, 1, 2)})
    out.update({("root", s): _mismatch_run("embedding", s, _embedding_in_root) for s in (0, 1, 2, 3)})
    return out


@functools.cache
def mismatches():
    from lab.launch import run_ranks
    return run_ranks(run_mismatches, 2, timeout=120)


def _embedding_reference():
    """One process on the global batch: each rank's loss is its rows' mean, rank 0 adds the branch's term on its
    rows, and data parallel averages the two: the global mean plus half of rank 0's term."""
    from lab.data import get_batch, load_corpus
    tokens, model = load_corpus(), RankBranch()

    def loss(m, batch):
        x, y = batch
        return m.body(x, y) + m.branch(m.body.tok_embeddings(x[:B // 2])).pow(2).mean() / 2
    ref = single_process(model, [get_batch(tokens, s, B, S, 0) for s in range(2)], lr=LR, weight_decay=0.0,
                         loss_fn=loss)
    return ref["model"].state_dict()


@pytest.mark.parametrize("case, first", [
    ("embedding", "gathers unit 0 (body.tok_embeddings) for forward, its 2nd forward since the last backward"),
    ("block", "gathers unit 2 (layers.1) for forward, its 2nd forward since the last backward"),
    ("swapped", "gathers unit 1 (layers.0) for forward")])
def test_a_unit_only_some_ranks_run_stops_every_rank_with_one_error(case, first):
    results = mismatches()
    for rank, res in enumerate(results):
        msg, seconds, _ = res[(case, 3)]
        assert msg is not None, f"{case}: rank {rank} trained on without an error"
        assert msg == results[0][(case, 3)][0], "every rank says the same"
        assert f"rank 0 {first} [" in msg and "rank 1 gathers unit" in msg, msg   # (and its size)
        assert "leave it out of units=" in msg and "reshard_after_forward=False" in msg, msg  # the fix
        assert seconds < 10, f"{case}: rank {rank} took {seconds:.1f} s to stop"
    if case == "swapped":  # equal sizes: without the check the gathers would have paired and swapped the data
        assert "rank 1 gathers unit 2 (layers.1) for forward" in results[0][(case, 3)][0]


def test_such_a_model_trains_equal_to_one_process_where_no_unit_is_gathered_apart():
    """Stages 0-2 never gather a unit; with units= leaving the embedding to the root unit, neither does 3."""
    want = _embedding_reference()
    for rank, res in enumerate(mismatches()):
        for key in [("embedding", s) for s in (0, 1, 2)] + [("root", s) for s in (0, 1, 2, 3)]:
            msg, _, state = res[key]
            assert msg is None, (rank, key, msg)
            assert max_diff(state, want) < TOL, (rank, key, max_diff(state, want))
