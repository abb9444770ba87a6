"""Speed (issue 25): torch.compile composed with every strategy, equal to one eager process."""
from harness import run_ranks
from lab.train_demo import reference_losses, run_layouts
from train import parse_args

COMMON = ["--steps", "3", "--global-batch-size", "8", "--seq-len", "16", "--lr", "3e-3"]
TWO = [["--dp-replicate", "2"]] + [["--dp-shard", "2", "--zero-stage", str(z)] for z in (1, 2, 3)] + [
    ["--tp", "2"], ["--tp", "2", "--sequence-parallel"], ["--cp", "2"], ["--cp", "2", "--cp-method", "ulysses"],
    ["--pp", "2", "--schedule", "gpipe", "--microbatches", "2"], ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2"],
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


def test_compile_composes_with_every_strategy_and_equals_one_eager_process():
    """--compile (inductor, on CPU): every block's forward compiled before anything wraps it, on DDP, ZeRO 1-3,
    HSDP, tp with and without sp, every pipeline schedule, ring and Ulysses, experts — float32 losses within 1e-5
    (relative) of one eager process. tp's f/g trace into one graph per block; ring attention's sends and the
    experts' data-dependent splits break it (still compiled between them)."""
    common = COMMON + ["--compile"]
    two = run_ranks(_compiled, 2, TWO, common, timeout=1500)[0]
    _check(two, COMMON)
    _check(run_ranks(_compiled, 4, [["--dp-replicate", "2", "--dp-shard", "2"]], common, timeout=600)[0], COMMON)
    by = {lay["flags"]: lay for lay in two}
    assert by["--tp 2"]["breaks"] == 0 and by["--cp 2"]["breaks"] > 0 and by["--experts 4 --dp-shard 2 --ep 2"]["breaks"] > 0
