"""What a demo prints, and how the ranks agree on a verdict (demos, tests and notebooks share these).

    print0(...)                           print on rank 0 only
    print_by_rank(text)                   each rank's lines, printed by rank 0 in rank order
    all_agree(ok)                         True on every rank only if `ok` held on every rank
    bytes_table(measured, formula, P)     a CommCounter summary next to a formula: API and ring bytes
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lab.instruments import wire_bytes
from mesh import collective_device


def print0(*args, **kwargs) -> None:
    """print on rank 0 only (or always, outside a process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def print_by_rank(text: str, group=None) -> None:
    """Rank 0 prints every rank's text, in rank order (lines from several processes never interleave)."""
    if not dist.is_initialized():
        print(text, flush=True)
        return
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, text, group=group)
    if dist.get_rank() == (dist.get_global_rank(group, 0) if group is not None else 0):
        print("\n".join(every), flush=True)


def all_agree(ok: bool, group=None) -> bool:
    """True on every rank if `ok` is true on every rank of `group` (one MIN all-reduce)."""
    if not dist.is_initialized():
        return bool(ok)
    flag = torch.tensor([1.0 if ok else 0.0], device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return flag.item() == 1.0


def bytes_table(measured: dict, formula: dict, group_size: int, indent: str = "    ") -> list[str]:
    """Lines comparing a CommCounter.summary() with a formula {op: API bytes}: per collective the API
    bytes measured | formula, and the ring bytes this rank sent | the formula's (instruments.wire_bytes)."""
    lines = []
    for op in sorted(set(measured) | set(formula)):
        got, want = measured.get(op, dict(bytes=0, wire_bytes=0.0, calls=0)), formula.get(op, 0)
        lines.append(f"{indent}{op:14s} API {got['bytes']:>11,} | {want:>11,}   ring {got['wire_bytes']:>12,.0f} | "
                     f"{wire_bytes(op, want, group_size):>12,.0f}   ({got['calls']} calls)")
    return lines
