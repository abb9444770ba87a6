"""Each instrument measures a known quantity exactly."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from harness import run_ranks
from mesh import all_gather_single, reduce_scatter_single
from lab.instruments import CommCounter, HeldBytes, SavedBytes, Timeline, memory_tracker, model_state_bytes, wire_bytes

K = 7  # an odd element count: a count off by one element shows


class _AllReduceInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


def _count_each_collective():
    P, r = dist.get_world_size(), dist.get_rank()
    out = {}
    with CommCounter() as c:
        dist.all_reduce(torch.ones(K))
    out["all_reduce"] = (c.calls(), c.bytes(), c.wire_bytes(), c.calls("all_reduce"))
    with CommCounter() as c:
        all_gather_single(torch.empty(P * K), torch.ones(K))
    out["all_gather"] = (c.calls("all_gather"), c.bytes(), c.wire_bytes())
    with CommCounter() as c:
        reduce_scatter_single(torch.empty(K), torch.ones(P * K))
    out["reduce_scatter"] = (c.calls("reduce_scatter"), c.bytes(), c.wire_bytes())
    with CommCounter() as c:
        dist.broadcast(torch.ones(K, dtype=torch.float64), src=0)
    out["broadcast"] = (c.calls("broadcast"), c.bytes())
    # uneven all-to-all: rank r sends (j + 1) rows of 3 floats to rank j
    splits_in = [j + 1 for j in range(P)]
    splits_out = [r + 1] * P
    with CommCounter() as c:
        dist.all_to_all_single(torch.empty(sum(splits_out), 3), torch.ones(sum(splits_in), 3),
                               splits_out, splits_in)
    out["all_to_all"] = (c.calls("all_to_all"), c.bytes(), c.wire_bytes())
    # a rank with nothing to send (rows of 3): rank 0 sends no rows, the others one row to each rank
    splits_in = [0] * P if r == 0 else [1] * P
    splits_out = [0] + [1] * (P - 1)
    with CommCounter() as c:
        dist.all_to_all_single(torch.empty(sum(splits_out), 3), torch.ones(sum(splits_in), 3),
                               splits_out, splits_in)
    out["all_to_all_empty"] = (c.calls("all_to_all"), c.bytes(), c.wire_bytes())
    with CommCounter() as c:
        peer = (r + 1) % P
        ops = [dist.P2POp(dist.isend, torch.ones(K), peer), dist.P2POp(dist.irecv, torch.empty(K), (r - 1) % P)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    out["p2p"] = (c.calls("send"), c.calls("recv"), c.bytes("send"), c.wire_bytes())
    with CommCounter() as c:  # functional collectives (what DTensor uses)
        y = funcol.all_reduce(torch.ones(K), "sum", dist.group.WORLD)
        funcol.wait_tensor(y)
    out["funcol"] = (c.calls("all_reduce"), c.bytes())
    with CommCounter() as c:  # a collective inside autograd's backward is seen too
        x = torch.ones(K, requires_grad=True)
        _AllReduceInBackward.apply(x).sum().backward()
    out["backward"] = (c.calls("all_reduce"), c.bytes())
    g = dist.new_group([0, 1])
    with CommCounter() as c:
        if r < 2:
            dist.all_reduce(torch.ones(K), group=g)
    out["group"] = (c.calls(group=[0, 1]), c.calls(group=list(range(P))) if P > 2 else 0)
    return out


def test_comm_counter_counts_calls_and_bytes_exactly():
    P = 4
    for r, out in enumerate(run_ranks(_count_each_collective, P, timeout=90)):
        b = 4 * K
        assert out["all_reduce"] == (1, b, 2 * (P - 1) / P * b, 1)
        assert out["all_gather"] == (1, P * b, (P - 1) * b)
        assert out["reduce_scatter"] == (1, P * b, (P - 1) * b)
        assert out["broadcast"] == (1, 8 * K)
        sent_rows = sum(j + 1 for j in range(P))
        assert out["all_to_all"] == (1, sent_rows * 12, (sent_rows - (r + 1)) * 12)
        assert out["all_to_all_empty"] == ((1, 0, 0.0) if r == 0 else (1, P * 12, (P - 1) * 12))
        assert out["p2p"] == (1, 1, b, b)
        assert out["funcol"] == (1, b)
        assert out["backward"] == (1, b)
        assert out["group"] == ((1 if r < 2 else 0), 0)


def test_wire_bytes_formulas():
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_gather", 1000, 4) == 750
    assert wire_bytes("reduce_scatter", 1000, 1) == 0
    assert wire_bytes("recv", 1000, 2) == 0


def test_model_state_bytes_by_category():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.Linear(6, 3, bias=False))
    n = sum(p.numel() for p in m.parameters())  # 66 + 18
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    before = model_state_bytes(m.parameters(), opt)
    assert before == dict(parameters=4 * n, gradients=0, optimizer=0, total=4 * n)
    m(torch.randn(2, 10)).sum().backward()
    opt.step()
    after = model_state_bytes(m.parameters(), opt)
    n_tensors = len(list(m.parameters()))
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a 4-byte step counter each
    assert after["gradients"] == 4 * n
    assert after["optimizer"] == 2 * 4 * n + 4 * n_tensors
    # views into one flat buffer count once
    flat = torch.zeros(100)
    views = [flat[:50], flat[50:]]
    assert model_state_bytes(views)["parameters"] == 400


def test_memory_tracker_sees_parameters_and_optimizer_state():
    m = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    with memory_tracker(m, opt) as mt:
        m(torch.randn(4, 32)).sum().backward()
        opt.step()
    peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]
    by_name = {str(k).split(".")[-1]: v for k, v in peak.items()}
    assert by_name["PARAM"] == (32 * 32 + 32) * 4
    assert by_name["GRAD"] == (32 * 32 + 32) * 4
    assert by_name["OPT"] >= (32 * 32 + 32) * 4  # one momentum buffer per parameter


def test_timeline_spans_are_ordered():
    tl = Timeline()
    with tl.span("a", mb=0):
        sum(range(1000))
    with tl.span("b"):
        pass
    a, b = tl.spans
    assert a["name"] == "a" and a["mb"] == 0 and 0 <= a["start"] <= a["end"] <= b["start"] <= b["end"]


def test_saved_bytes_counts_what_autograd_keeps_for_backward():
    """SavedBytes sums the storages autograd saves, once each, on real and meta tensors alike: not the
    parameters, not a tensor only something else holds (as gloo's thread may hold a finished collective's
    buffer: HeldBytes counts it), nothing once backward ran; under checkpointing, what the checkpoint keeps."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def keep_mm(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    for device in ("cpu", "meta"):
        w = torch.nn.Parameter(torch.ones(8, 16, device=device))
        elsewhere = []

        def f(x):
            h = x * 2                    # [4, 8]; a product with a number saves nothing
            y = h @ w                    # saves h (128 B) and w (a parameter)
            z = y.relu()                 # saves its output z [4, 16] (256 B)
            elsewhere.append(y)          # alive, but not for the backward (unless selective keeps it)
            return (z[:, :8] * z[:, 8:]).sum()   # saves two views of z: its storage once

        for how, want in (("none", 128 + 256), ("full", 128), ("selective", 128 + 256)):
            x = torch.ones(4, 8, device=device, requires_grad=True)   # (128 B)
            elsewhere.clear()
            with SavedBytes() as saved, HeldBytes() as held:
                if how == "none":
                    out = f(x)
                else:   # full keeps x; selective also the mm's output y (256 B); both recompute the rest
                    ctx = (lambda: create_selective_checkpoint_contexts(keep_mm)) if how == "selective" else None
                    out = checkpoint(f, x, use_reentrant=False, **({"context_fn": ctx} if ctx else {}))
            assert saved.held(exclude=[w]) == want, (device, how, saved.held(exclude=[w]))
            assert saved.held(exclude=[w, x]) == want - (128 if how != "none" else 0)
            if how == "none":   # all it made, y kept elsewhere too
                assert held.held(exclude=[w, out]) == want + 256
            out.backward()
            elsewhere.clear()   # (selective's recompute put the cached y there again)
            assert saved.held(exclude=[w]) == 0, (device, how)
