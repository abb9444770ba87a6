"""The pictures the README shows, drawn by the course's own code — one command draws them all:

    python -m lab.figures [--out notebooks/figures]

    mesh_groups.png      mesh.Mesh's real groups on 8 ranks [pp 2, dp_shard 2, tp 2]: each dimension's groups
    pipeline_1f1b_zb.png pipeline.simulate of 1F1B and zero bubble (ZB-H1), 4 ranks, 8 micro-batches: every F, B, W
    ring_attention.png   ring_attention.ring_schedule on 4 cp ranks: which rank computes each block of the causal
                         score matrix, at which step of the ring, contiguous against zigzag
    zero_memory.png      each rank's model state at ZeRO stages 0-3, measured on 4 gloo ranks (fsdp_demo's
                         train_and_measure), by category, beside the formulas
    published_runs.png   lab.plan_time's predicted tokens/s per GPU against what 55 published runs measured
                         (lab/published_runs.py), each from its config, layout and framework's bundle

tests/test_figures.py runs it. Nothing here is drawn by hand: change the code and the pictures change.
"""
from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")  # files only: no screen on a course machine
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "figures")
COLORS = plt.get_cmap("tab10").colors


def mesh_groups(path: str) -> None:
    """8 ranks as the grid [pp, dp_shard, tp] lays them out; one panel per dimension, each group one colour."""
    from mesh import Mesh
    shape = dict(pp=2, dp_shard=2, tp=2)
    meshes = [Mesh(**shape, world_size=8, rank=r) for r in range(8)]
    dims = ("tp", "dp_shard", "pp")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, dim in zip(axes, dims):
        groups = sorted({tuple(m.ranks(dim)) for m in meshes})
        color = {r: COLORS[k % 10] for k, g in enumerate(groups) for r in g}
        for r, m in enumerate(meshes):  # pp blocks side by side; inside one, dp_shard rows and tp columns
            c = m.coords
            x, y = c["pp"] * 2.6 + c["tp"], 1 - c["dp_shard"]
            ax.add_patch(Rectangle((x, y), 0.9, 0.9, color=color[r], alpha=0.85))
            ax.text(x + 0.45, y + 0.45, str(r), ha="center", va="center", fontsize=14, color="white", weight="bold")
        ax.set_xlim(-0.2, 4.8)
        ax.set_ylim(-0.3, 2.3)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"{dim} groups: " + "  ".join(str(list(g)) for g in groups), fontsize=9)
        for p in range(2):
            ax.text(p * 2.6 + 0.95, 2.05, f"pp stage {p}", ha="center", fontsize=9)
    fig.suptitle("Mesh(pp=2, dp_shard=2, tp=2) on 8 ranks: rank = (pp·D + dp_shard)·T + tp, tp innermost "
                 "(columns: tp, rows: dp_shard)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pipeline_timelines(path: str, p: int = 4, m: int = 8) -> None:
    """pipeline.simulate's timeline of 1F1B and ZB-H1 at t_f = t_b = t_w = 1: every compute of every rank."""
    import pipeline
    shades = {"F": COLORS[0], "B": COLORS[1], "W": COLORS[2]}
    fig, axes = plt.subplots(2, 1, figsize=(12, 5), sharex=True)
    sims = {name: pipeline.simulate(pipeline.SCHEDULES[name](p, m)) for name in ("1f1b", "zb")}
    for ax, (name, title) in zip(axes, [("1f1b", "1F1B (backward unsplit: B+W = 2)"), ("zb", "zero bubble ZB-H1")]):
        sim = sims[name]
        for r, spans in enumerate(sim["spans"]):
            for a, start, end in spans:
                if a.op in pipeline.COMPUTE and end > start:
                    ax.add_patch(Rectangle((float(start), p - 1 - r), float(end - start), 0.85,
                                           color=shades["B" if a.op == "B" else a.op], alpha=0.9, ec="white"))
                    ax.text(float(start + end) / 2, p - 1 - r + 0.42, f"{a.op}{a.mb}", ha="center", va="center",
                            fontsize=7, color="white")
        ax.set_ylim(-0.1, p)
        ax.set_xlim(0, float(max(s["total"] for s in sims.values())))
        ax.set_yticks([p - 1 - r + 0.42 for r in range(p)], [f"rank {r}" for r in range(p)])
        ax.set_title(f"{title}: step {float(sim['total']):g} units, bubble (idle share) "
                     f"{float(sim['bubble'][0]):.3f} on rank 0", fontsize=10)
    axes[-1].set_xlabel(f"time (units of one micro-batch's forward on one stage); p = {p} ranks, m = {m} micro-batches")
    fig.legend(handles=[Patch(color=shades[k], label=lbl) for k, lbl in
                        [("F", "F forward"), ("B", "B backward (1F1B: input and weight gradient)"),
                         ("W", "W weight gradient")]], loc="upper center", fontsize=8, ncol=3)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ring_attention(path: str, cp: int = 4) -> None:
    """The causal score matrix cut into 2·cp chunks: each block coloured by the rank that computes it (the one
    holding its queries), labelled with the ring step at which that rank holds its keys."""
    import ring_attention as ra
    n = 2 * cp
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.4))
    for ax, layout in zip(axes, ("contiguous", "zigzag")):
        per = n // (cp * len(ra.chunk_ids(layout, cp, 0)))  # units of S/2cp in one chunk of the layout
        work = [0] * cp
        for r in range(cp):
            mine = ra.chunk_ids(layout, cp, r)
            for t, src, pairs in ra.ring_schedule(cp, r, layout):
                theirs = ra.chunk_ids(layout, cp, src)
                for i, j, diagonal in pairs:
                    for qi in range(mine[i] * per, (mine[i] + 1) * per):  # (in units of S/2cp)
                        for kj in range(theirs[j] * per, (theirs[j] + 1) * per):
                            if kj > qi:
                                continue
                            work[r] += 0.5 if kj == qi else 1
                            ax.add_patch(Rectangle((kj, n - 1 - qi), 1, 1, color=COLORS[r], alpha=0.35 + 0.6 * (kj < qi)))
                            ax.text(kj + 0.5, n - 0.5 - qi, f"t{t}", ha="center", va="center", fontsize=8)
        ax.set_xlim(0, n)
        ax.set_ylim(0, n)
        ax.set_aspect("equal")
        ax.set_xticks([k + 0.5 for k in range(n)], [str(k) for k in range(n)], fontsize=7)
        ax.set_yticks([n - 0.5 - k for k in range(n)], [str(k) for k in range(n)], fontsize=7)
        ax.set_xlabel("key chunk (S/2cp tokens each)")
        ax.set_ylabel("query chunk")
        ax.set_title(f"{layout}: blocks of work per rank {[w for w in work]}", fontsize=10)
    axes[1].legend(handles=[Patch(color=COLORS[r], label=f"rank {r}") for r in range(cp)], fontsize=8, loc="upper right")
    fig.suptitle(f"Ring attention on cp = {cp} ranks: who computes each causal block, and at which ring step t "
                 f"(t0: its own keys; half-shaded: the masked diagonal)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _zero_measure():
    """On each rank: model state by category at stages 0-3, after one step of the tiny model (and the formulas)."""
    from lab.fsdp_demo import train_and_measure
    return [{k: train_and_measure(s, "tiny", steps=1, batch=4, seq=16)[k] for k in ("memory", "memory_formula")}
            for s in range(4)]


def zero_memory(path: str, P: int = 4) -> None:
    """Model-state bytes per rank at each ZeRO stage, measured on P gloo ranks (rank 0), stacked by category,
    with the formula's total beside each bar."""
    from lab.launch import run_ranks
    measured = run_ranks(_zero_measure, P, timeout=300)[0]
    cats = ("parameters", "gradients", "master", "optimizer")
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for s, res in enumerate(measured):
        bottom = 0.0
        for k, cat in enumerate(cats):
            v = res["memory"].get(cat, 0) / 2**20
            ax.bar(s, v, bottom=bottom, color=COLORS[k], label=cat if s == 0 else None, width=0.6)
            bottom += v
        ax.plot([s - 0.35, s + 0.35], [res["memory_formula"]["total"] / 2**20] * 2, color="black", lw=2,
                label="formula (ZeRO §5)" if s == 0 else None)
        ax.text(s, bottom * 1.02, f"{res['memory']['total'] / 2**20:.2f} MiB", ha="center", fontsize=9)
    ax.set_xticks(range(4), [f"stage {s}" for s in range(4)])
    ax.set_ylabel("model state per rank (MiB)")
    ax.set_title(f"ZeRO on {P} gloo ranks, the tiny model in fp32 with AdamW: measured on rank 0", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def published_runs(path: str) -> None:
    """Each published run's tokens/s per GPU against the planner's prediction (lab.plan_time.published_report),
    on log axes, with the 0.8x and 1.25x band."""
    from lab import plan_time as T
    rows = T.PUBLISHED + T.FURTHER
    _, got = T.published_report()
    fig, ax = plt.subplots(figsize=(7.5, 6))
    kinds = (("torchtitan, H100", lambda row: "torchtitan" in row.source and not row.further, "o", COLORS[0]),
             ("Megatron-LM 2021, A100", lambda row: "Narayanan" in row.source and not row.further, "o", COLORS[1]),
             ("held-out runs: torchtitan (H200, A100, 405B), llm-foundry, BLOOM", lambda row: row.further, "D",
              COLORS[2]))
    for label, pick, marker, color in kinds:
        pts = [(row.tokens_per_gpu, r["per_gpu"]) for row, r in zip(rows, got) if pick(row)]
        ax.scatter(*zip(*pts), marker=marker, color=color, label=f"{label} ({len(pts)})", zorder=3)
    lo, hi = 10, 60000
    for k, style in ((1, "-"), (T.TARGET_BAND[0], ":"), (T.TARGET_BAND[1], ":")):
        ax.plot([lo, hi], [k * lo, k * hi], style, color="gray", lw=1)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="published tokens/s per GPU",
           ylabel="predicted tokens/s per GPU", title="the planner against published runs (dotted: 0.8x, 1.25x)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FIGURES = {"mesh_groups.png": mesh_groups, "pipeline_1f1b_zb.png": pipeline_timelines,
           "ring_attention.png": ring_attention, "zero_memory.png": zero_memory,
           "published_runs.png": published_runs}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="draw the pictures the README shows, from the course's own code")
    ap.add_argument("--out", default=OUT, help="the folder to write them to")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, draw in FIGURES.items():
        draw(os.path.join(args.out, name))
        print(os.path.join(args.out, name))


if __name__ == "__main__":
    main()
