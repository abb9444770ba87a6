"""Test helpers: ranks from launch.py, and the single-process reference every test compares with."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import torch

from launch import RankError, run_ranks  # noqa: F401  (re-exported for the tests)


# ---- the single-process reference ---------------------------------------------------

def reference_model(cfg="tiny", seed: int = 0, dtype=torch.float32):
    """The same model every parallel run starts from, in one process."""
    from model import build_model
    return build_model(cfg, seed=seed, dtype=dtype)


def train_reference(model, batches, lr: float = 1e-3, optimizer_cls=torch.optim.AdamW, **opt_kwargs):
    """Train a deep copy of `model` on the full global batches, one optimizer step each.

    batches: list of (inputs, targets) global batches. Returns (losses, trained copy).
    """
    model = copy.deepcopy(model)
    opt = optimizer_cls(model.parameters(), lr=lr, **opt_kwargs)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


def global_batches(n_steps: int, global_batch: int, seq_len: int, seed: int = 0):
    """The first n_steps global batches of the built-in corpus."""
    from data import get_batch, load_corpus
    tokens = load_corpus()
    return [get_batch(tokens, s, global_batch, seq_len, seed) for s in range(n_steps)]


# ---- running a lesson the way a learner does ---------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script: str, *args: str, nproc: int | None = None, timeout: float = 240) -> str:
    """Run `torchrun --nproc_per_node nproc script args` (or plain `python script args` when
    nproc is None) from the repository root; check it exits 0 and prints no warning; return stdout."""
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    env = dict(os.environ, OMP_NUM_THREADS="1", COURSE_TIMEOUT="120")
    p = subprocess.run([sys.executable, *launcher, script, *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} {args} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert "Warning" not in p.stderr, p.stderr[-3000:]  # runs warning-free (no deprecated calls)
    return p.stdout
