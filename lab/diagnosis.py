"""What is wrong with a tensor, in words a learner can act on: what a run gave against what one process gives,
read as a pattern.

    close(got, want)                 equal to rounding: every element within TOL·max(1, |want|) (float64)
    pattern(got, want, scales, candidates)
                                     the shape of the difference: another shape, NaN, a typical mistake's result (a
                                     candidate), zeros, a multiple (P×, 1/P: the scales), a sign, the transpose, which
                                     part is wrong (the indices of the dimension that holds every wrong element), the
                                     right values in another order along a dimension, or a narrower dtype's rounding
    data_scales(P)                   the multiples data parallelism gets wrong: P× (the sum not divided), 1/P (twice)
    slice_pattern(...)               a flat buffer of P slices, one per rank, after a step: a slice stale, or holding
                                     another slice's update (the wrong shard), or the new slices never gathered
    compare_named(...)               every rank's named tensors against the expected: the first failure in full (rank,
                                     name, how far off, the pattern), then how many more and whether the same way
    formula_line(what, want, got)    a measured count or size against its formula

It knows no grader and no exercise, and imports torch alone: what explains a failed check explains any parallel run
that differs from one process.
"""
from __future__ import annotations

import torch

TOL = 1e-9        # float64: equal to one process means equal to rounding


def close(got, want, tol=TOL) -> bool:
    return tuple(got.shape) == tuple(want.shape) and bool(
        ((got.double() - want.double()).abs() <= tol * max(1.0, want.double().abs().max().item() if want.numel() else 1)).all())


def pattern(got, want, scales=(), candidates=()) -> str:
    """The shape of the difference, in words a learner can act on. scales: [(factor, explanation)];
    candidates: [(label, tensor)] — what a typical mistake would give."""
    if tuple(got.shape) != tuple(want.shape):
        if got.dim() == 2 and tuple(got.shape) == tuple(want.shape)[::-1]:
            return f"shape {tuple(got.shape)} where {tuple(want.shape)} is expected: transposed"
        return f"shape {tuple(got.shape)} where {tuple(want.shape)} is expected"
    g, w = got.double().flatten(), want.double().flatten()
    bad = ~torch.isfinite(g)
    if bad.any():
        return f"{int(bad.sum())} of {g.numel()} values are NaN or infinite (an overflow, or 0/0)"
    for label, cand in candidates:
        if cand is not None and close(got, cand, 1e-8):
            return label
    scale = w.abs().max().item()
    if scale == 0:
        return "nonzero where zeros are expected"
    if g.abs().max().item() <= 1e-12 * scale:
        return "all zeros where values are expected: nothing arrived, or nothing was written"
    c = (g @ w / (w @ w)).item()
    if abs(c - 1) > 1e-6 and (g - c * w).abs().max().item() <= 1e-6 * scale:
        for factor, why in scales:
            if abs(c - factor) <= 1e-6 * abs(factor):
                return why
        if abs(c + 1) < 1e-6:
            return "the expected with its sign flipped"
        return f"{c:.4g}× the expected"
    if got.dim() == 2 and got.shape[0] == got.shape[1] and close(got, want.T, 1e-8):
        return "the transpose of the expected"
    moved = _permuted(got.double(), want.double())
    if moved:
        return moved
    wrong = ~torch.isclose(g, w, rtol=1e-7, atol=1e-9 * scale)
    k = int(wrong.sum())
    rel = (g - w).abs().max().item() / scale
    if 0 < k < g.numel() and not (rel < 2e-2 and k > g.numel() // 2):
        idx = wrong.nonzero().flatten()
        return (f"wrong in {k} of {g.numel()} elements ({_where_wrong(wrong.view(got.shape), idx)}), right "
                f"elsewhere")
    if rel < 2e-2:
        like = "float32" if rel < 1e-5 else "bfloat16 (or float16)"
        return (f"close to the expected but beyond float64 rounding (largest difference {rel:.1e} of the largest "
                f"value): like {like} arithmetic somewhere — a cast to a narrower dtype, or a sum kept in one")
    return (f"wrong everywhere, in no simple pattern (not a multiple, sign, transpose, reordering or rounding of the "
            f"expected; largest difference at {_index(got.shape, int((g - w).abs().argmax()))})")


def _index(shape, flat: int) -> str:
    """A flat index as the element's index [i, j, ...]."""
    out = []
    for n in reversed(tuple(shape)):
        out.append(flat % n)
        flat //= n
    return "[" + ", ".join(map(str, reversed(out))) + "]" if out else "[]"


def _where_wrong(wrong, idx) -> str:
    """Which part holds every wrong element: the indices of the dimension that confines them most, else the flat range."""
    best = None
    for d in range(wrong.dim()):
        if wrong.shape[d] < 2:
            continue
        rows = wrong.transpose(0, d).reshape(wrong.shape[d], -1).any(1).nonzero().flatten().tolist()
        if len(rows) < wrong.shape[d] and (best is None or len(rows) / wrong.shape[d] < best[1]):
            best = (d, len(rows) / wrong.shape[d], rows)
    if best is None:
        return f"flat indices {idx[0].item()} to {idx[-1].item()}"
    d, _, rows = best
    shown = ", ".join(map(str, rows[:6])) + (", ..." if len(rows) > 6 else "")
    return f"only at index{'es' if len(rows) > 1 else ''} {shown} of dimension {d} (of {wrong.shape[d]})"


def _permuted(got, want) -> str:
    """'the slices along dimension d in another order' when got is want with its slices along one dimension moved."""
    for d in range(got.dim()):
        n = got.shape[d]
        if n < 2:
            continue
        gs, ws = got.movedim(d, 0).reshape(n, -1), want.movedim(d, 0).reshape(n, -1)
        tol = 1e-9 * max(1.0, want.abs().max().item())
        dist = (gs[:, None, :] - ws[None, :, :]).abs().amax(-1)           # [n, n]
        match = [int(j) for j in dist.argmin(1)]
        if all(dist[i, j] <= tol for i, j in enumerate(match)) and match != list(range(n)):
            moves = [f"{i} holds {j}" for i, j in enumerate(match) if i != j][:4]
            return (f"the right values in another order: along dimension {d} (of {n}), index "
                    f"{'; '.join(moves)} of the expected" + ("; ..." if sum(i != j for i, j in enumerate(match)) > 4
                                                            else ""))
    return ""


def data_scales(P: int) -> list:
    return [(P, f"{P}× the expected ({P} = P, the group's size): the sum was not divided by P"),
            (1 / P, f"1/{P} of the expected: divided by P once too often")] if P > 1 else []


def slice_pattern(got, want, before, n, P, rank, scales=()) -> str:
    """A flat buffer of P slices of n elements (rank r owns [r·n, (r+1)·n)) after a step, on rank `rank`: each slice
    read on its update (got − before against want − before) — right, stale, another slice's update, or a pattern
    (scales: [(factor, explanation)] read before data_scales(P)'s)."""
    dg, dw = got - before, want - before
    moves = [bool(dw[j * n:(j + 1) * n].abs().max() > 0) for j in range(P)]
    parts = []
    for j in range(P):
        g, w = dg[j * n:(j + 1) * n], dw[j * n:(j + 1) * n]
        if close(g, w):
            parts.append("ok")
            continue
        other = [k for k in range(P) if k != j and moves[k] and close(g, dw[k * n:(k + 1) * n])]
        if other:
            parts.append(f"slice {other[0]}")
        elif moves[j] and g.abs().max() == 0:
            parts.append("stale")
        else:
            parts.append(pattern(g, w, list(scales) + data_scales(P)))
    if P > 1 and parts[rank] == "ok" and all(p == "stale" for j, p in enumerate(parts) if j != rank):
        return (f"only this rank's slice [{rank * n}, {(rank + 1) * n}) was updated, the other ranks' slices are as "
                f"before the step: their new values never arrived (the all-gather after the step is missing)")
    if all(p == "stale" for j, p in enumerate(parts) if moves[j]):
        return ("no slice changed, this rank's own neither: the new slices never reached the flat buffer the model "
                "computes with (the all-gather after the step is missing)")
    if parts[rank].startswith("slice "):
        k = int(parts[rank].split()[1])
        return (f"this rank's slice [{rank * n}, {(rank + 1) * n}) got the update of slice {k}: the wrong shard — rank r "
                f"owns [r·n, (r+1)·n) of the flat buffer")
    bad = [(j, p) for j, p in enumerate(parts) if p != "ok"]
    if len({p for _, p in bad}) == 1 and len(bad) == sum(moves):
        return f"every slice: {bad[0][1]}"
    return "; ".join(f"slice {j} (rank {j}'s): {p}" for j, p in bad)


def compare_named(P, results, key, want_of, *, what="", scales=(), candidates_of=None, tol=TOL, before_of=None,
                  reverse=False) -> list[str]:
    """Every rank's tensors results[r][key][name] against want_of(r, name): the first failure in full, then how many
    more. candidates_of(r, name) -> [(label, tensor)]; before_of(r, name): the value before the step, so that the
    pattern is read on the update (got − before against want − before); reverse: look from the last tensor (the one
    nearest the loss) back."""
    fails = []
    for r, res in enumerate(results):
        for name, got in (reversed if reverse else iter)(list(res[key].items())):
            want = want_of(r, name)
            if want is None or close(got, want, tol):
                continue
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else float("nan")
            cands = candidates_of(r, name) if candidates_of else ()
            if before_of is not None and got.shape == want.shape:
                b0 = before_of(r, name)
                why = pattern(got - b0, want - b0, scales, [(label, c - b0) for label, c in cands])
            else:
                why = pattern(got, want, scales, cands)
            fails.append((r, name, diff, why))
    if not fails:
        return []
    r, name, diff, why = fails[0]
    n = sum(len(res[key]) for res in results)
    lines = [f"rank {r}, {name}{what}: off by {diff:.2e} — {why}"]
    same = sum(f[3] == why for f in fails)
    ranks = sorted({f[0] for f in fails})
    if len(fails) > 1:
        lines.append(f"{len(fails)} of the {n} tensors of all ranks differ, on rank(s) {ranks}" +
                     ("; all the same way" if same == len(fails) else f"; {same} of them the same way" if same > 1 else ""))
    return lines


def formula_line(what: str, want, got, why: str = "") -> list[str]:
    return [] if want == got else [f"{what}: expected {_n(want)}, measured {_n(got)}" + (f" — {why}" if why else "")]


def _n(x):
    return f"{x:,}" if isinstance(x, int) else str(x)
