"""Speed (issue 25): torch.compile composed with every strategy, equal to one eager process."""
from harness import run_ranks
from lab.train_demo import reference_losses, run_layouts
from train import parse_args

COMMON = ["--steps", "3", "--global-batch-size", "8", "--seq-len", "16", "--lr", "3e-3"]
# ZeRO-1 and GPipe are left out: their blocks run the forward and backward ZeRO-2's and 1F1B's do (ZeRO-1 reduces after
# the backward where ZeRO-2 reduces in its hooks; GPipe orders the same micro-batches otherwise), outside the graphs
TWO = [["--dp-replicate", "2"]] + [["--dp-shard", "2", "--zero-stage", str(z)] for z in (2, 3)] + [
    ["--tp", "2"], ["--tp", "2", "--sequence-parallel"], ["--cp", "2"], ["--cp", "2", "--cp-method", "ulysses"],
    ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2"],
    ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--layers", "4", "--microbatches", "2"],
    ["--pp", "2", "--schedule", "zb", "--microbatches", "2"], ["--experts", "4", "--dp-shard", "2", "--ep", "2"]]


def _compiled(layouts, common):
    """Rank function: run_layouts, and how many graphs dynamo made and how often it broke one (per layout)."""
    import torch._dynamo
    c, out = torch._dynamo.utils.counters, []
    for flags in layouts:  # (a block already compiled for an earlier layout is reused: counts are new graphs)
        graphs, breaks = c["stats"]["unique_graphs"], sum(c["graph_break"].values())
        res = run_layouts([flags], common)[0]
        out.append(dict(res, graphs=c["stats"]["unique_graphs"] - graphs, breaks=sum(c["graph_break"].values()) - breaks))
    return out


def _check(results, common):
    for lay in results:
        want = reference_losses(parse_args(common + lay["flags"].split()))  # eager, one process
        err = max(abs(a - b) / abs(b) for a, b in zip(lay["losses"], want))
        assert err < 1e-5, (lay["flags"], err)
    assert sum(lay["graphs"] for lay in results) >= 1, "nothing was compiled"


# inductor's own kernels (C++ built by the compiler: ~20 s a layout on 2 cores, both ranks building the same graph) on
# the layout whose graph holds the most: tp's f/g with sequence parallel, its collectives inside the graph, lowered by
# inductor; the rest through torch.compile's aot_eager backend, which traces, lifts the parameters to inputs and breaks
# the graph as inductor does, and runs it eagerly (ZeRO-3's gathers and frees are hooks outside its block's graph,
# whose inputs are the gathered parameters of each call either way)
INDUCTOR = ("--tp 2 --sequence-parallel",)
AOT = ["--compile-backend", "aot_eager"]


def test_compile_composes_with_every_strategy_and_equals_one_eager_process():
    """--compile: every block's forward compiled before anything wraps it, on DDP, ZeRO 2-3, tp with and without sp,
    1F1B, interleaved and zero bubble, ring and Ulysses, experts — float32 losses within 1e-5 (relative) of one eager
    process; inductor on CPU for tp + sp (INDUCTOR; HSDP's blocks run ZeRO-3's graphs, its replicas' all-reduce
    outside them). tp's f/g trace into one graph per block; ring attention's sends and the experts'
    data-dependent splits break it (still compiled between them)."""
    common = COMMON + ["--compile"]
    twos = run_ranks(_compiled, 2, [f + ([] if " ".join(f) in INDUCTOR else AOT) for f in TWO], common, timeout=1500)
    for rank in twos:
        _check(rank, COMMON)   # every rank: the global losses, and what it compiled itself (a pipeline stage its own)
    for two in twos:
        by = {lay["flags"].replace(" " + " ".join(AOT), ""): lay for lay in two}
        assert by["--tp 2"]["breaks"] == 0 and by["--cp 2"]["breaks"] > 0 and \
            by["--experts 4 --dp-shard 2 --ep 2"]["breaks"] > 0


# ---- float8 matmuls, by hand (lab/model.py) ------------------------------------------------------------------

def test_the_float8_cast_is_the_formats_rounding_of_the_scaled_tensor():
    import torch

    from lab.model import E4M3, E5M2, to_float8
    x = torch.randn(256, 64, dtype=torch.float64) * 3
    for fmt, bits in ((E4M3, 3), (E5M2, 2)):
        q, scale = to_float8(x, fmt)
        largest = torch.finfo(fmt).max
        assert torch.isclose(scale, largest / x.abs().max().float())            # amax lands on the largest value
        assert torch.equal(q, (x.float() * scale).to(fmt))                       # round to nearest, as the dtype does
        normal = (x.float() * scale).abs() >= torch.finfo(fmt).smallest_normal      # (subnormals: absolute error)
        err = ((q.double() / scale.double() - x).abs() / x.abs())[normal]
        assert err.max() <= 2.0 ** -(bits + 1) + 1e-12, (fmt, err.max())          # half a unit in the last place


def test_a_float8_layer_against_float64():
    """Forward (e4m3 x and w) and backward (e5m2 gradient) within the formats' rounding of the float64 result:
    each operand carries a relative error up to 2^-4 (e4m3) or 2^-3 (e5m2), so the products' relative error in
    norm stays a few percent."""
    import torch

    from lab.model import float8_linear
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, 64, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(48, 64, generator=g, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(8, 16, 48, generator=g, dtype=torch.float64)
    float8_linear(x, w).backward(gy)
    y = float8_linear(x.detach(), w.detach())
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert 1e-4 < rel(y, x.detach() @ w.detach().T) < 2 ** -4
    assert 1e-4 < rel(x.grad, gy @ w.detach()) < 2 ** -3
    assert 1e-4 < rel(w.grad, gy.flatten(0, 1).T @ x.detach().flatten(0, 1)) < 2 ** -3


def test_float8_training_stays_within_a_band_of_bf16():
    """The tiny model, 20 steps in bf16 with and without --float8, on ZeRO-3 and on tp 2: the losses differ
    (the matmuls really are float8) but by less than 0.02 (measured: 0.0035 and 0.0011)."""
    common = ["--dtype", "bfloat16", "--steps", "20", "--global-batch-size", "8", "--seq-len", "32", "--lr", "3e-3"]
    for res in run_ranks(run_layouts, 2, [["--dp-shard", "2"], ["--dp-shard", "2", "--float8"], ["--tp", "2"],
                                          ["--tp", "2", "--float8"]], common, timeout=600):  # every rank
        for plain, f8 in ((res[0], res[1]), (res[2], res[3])):
            diff = max(abs(a - b) for a, b in zip(plain["losses"], f8["losses"]))
            assert 0 < diff < 0.02, (f8["flags"], diff)


def test_float8_changes_the_linear_layers_and_keeps_the_embedding_head_and_router():
    from lab.model import build_model, get_config, use_float8
    dense = use_float8(build_model(get_config("tiny")))
    assert sorted({n.split(".")[-1] for n in dense}) == ["w1", "w2", "w3", "wk", "wo", "wq", "wv"] and len(dense) == 14
    moe = use_float8(build_model(get_config("tiny", n_experts=4)))
    assert sorted({n.split(".")[-1] for n in moe}) == ["wk", "wo", "wq", "wv"]   # no router, no stacked experts
