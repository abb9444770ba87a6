"""FSDP's flat parameter (lesson 2, fsdp.py): a unit's parameters as views of one flat buffer, one slice per rank.

ZeRO moves a unit's parameters and gradients as ONE tensor each (Zhao et al. 2023, "PyTorch FSDP",
arXiv:2304.11277 §3.2.1, the FlatParameter): the unit's k parameters, Ψ_u elements in all, are laid end
to end in a buffer [N], N = Ψ_u padded up to a multiple of P, so that rank r owns the slice
[r·n, (r+1)·n), n = N/P. Every parameter of the module becomes a view of the buffer, so gathering the
buffer is gathering the unit, and freeing its storage frees every parameter at once. What one unit moves
(API bytes; b_p compute bytes per element, b_m bytes of the master dtype the gradients are reduced in:
fp32, also under a bf16 compute copy; float64 for a float64 model):

    unshard  all-gather      [n] per rank -> [N]        b_p·N      (stage 3: before forward and backward)
    publish  all-gather      my new slice -> [N]        b_p·N      (stages 1-2: after the step)
    reduce   reduce-scatter  [N] gradients -> my [n]    b_m·N      (stages 1-3; stage 0 all-reduces [N])

fsdp.py decides WHEN (its hooks and its optimizer); this class is WHAT moves and where it lives.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from mesh import all_gather_single, collective_device, reduce_scatter_single


class FlatUnit:
    """One unit's parameters on one group as a flat buffer [N]; this rank keeps the slice [r·n, (r+1)·n),
    n = N/P (stage 0: P = 1, the whole buffer).
    buf     [N] compute dtype: the module's parameters are views of it (stage 3 frees it between uses)
    shard   [n] compute dtype: my slice (a view of buf in stages 0-2; its own tensor in stage 3)
    master  [n] the parameters' dtype (fp32): what the optimizer updates; the shard itself if no cast
    pieces  [(i, a, b, piece)]: piece = master[a:b], my part of parameter i, the optimizer's parameter
    """

    def __init__(self, entries, stage, group, divide_by, across=None, param_dtype=None, init_fn=None):
        # entries [(names, holders [(module, attr)], param)]: names[0] as named_parameters() has it, then aliases
        self.stage, self.group = stage, group
        self.divide_by, self.across = divide_by, across  # read by fsdp.py's optimizer: how to finish a reduction
        self.P, self.r = (dist.get_world_size(group), dist.get_rank(group)) if stage > 0 else (1, 0)
        self.alone = dist.get_world_size(group) == 1  # stage 0 on a group of one skips its all-reduce
        self.aliases, self.shapes = [e[0] for e in entries], [tuple(e[2].shape) for e in entries]
        self.names, self.numels = [a[0] for a in self.aliases], [math.prod(s) for s in self.shapes]
        self.offsets = [0, *itertools.accumulate(self.numels)][:-1]  # of each parameter in buf
        self.N = -(-sum(self.numels) // self.P) * self.P  # padded: every rank gets n = N/P elements
        self.n = self.N // self.P
        master = _my_slice(self, entries, init_fn)  # [n], made from my part of each parameter only
        self.dtype, same = param_dtype or master.dtype, param_dtype in (None, master.dtype)
        self.buf = torch.empty(self.N, dtype=self.dtype, device=master.device)
        if stage == 3:  # my slice lives apart from buf, which holds bytes only while gathered
            self.shard = master if same else torch.empty_like(master, dtype=self.dtype)
        else:           # my slice is a view of buf; with no cast the optimizer steps it in place
            self.shard = self.buf[self.r * self.n:(self.r + 1) * self.n]
            master = self.shard.copy_(master) if same else master
        self.master = nn.Parameter(master)
        self.pieces = [(i, a, b, nn.Parameter(self.master.detach()[a:b])) for i, a, b in self.spans()]
        self.params = [_repoint(e, view) for e, view in zip(entries, self.views(self.buf.data))]
        self.used = torch.zeros(len(self.params), dtype=torch.int32, device=master.device)  # got a gradient here
        self.gather_work, self.unreduced = None, False  # unreduced: fsdp.py deferred this unit's reduction
        self.publish()

    def spans(self):
        """[(i, a, b)]: parameter i covers [a, b) of my slice (parameters outside it are left out)."""
        lo, hi = self.r * self.n, (self.r + 1) * self.n
        return [(i, max(o, lo) - lo, min(o + k, hi) - lo) for i, (o, k) in enumerate(zip(self.offsets, self.numels))
                if max(o, lo) < min(o + k, hi)]

    def views(self, flat):
        """A flat [N] tensor as one view per parameter, in its shape."""
        return [t.view(s) for t, s in zip(flat[:sum(self.numels)].split(self.numels), self.shapes)]

    @torch.no_grad()
    def publish(self):
        """After the master slice changed (a step, a load): refresh every compute copy of it."""
        if self.shard.data_ptr() != self.master.data_ptr():
            self.shard.copy_(self.master)  # e.g. fp32 -> bf16
        if self.stage in (1, 2):
            all_gather_single(self.buf, self.shard, group=self.group)
        if self.stage == 3:
            self.free()  # a gathered copy would be stale: the next use gathers the new values

    def unshard(self):
        """Stage 3: start the all-gather of buf, [n] per rank -> [N], unless it is gathered already."""
        if self.gather_work is None and self.buf.untyped_storage().size() == 0:
            self.buf.untyped_storage().resize_(self.N * self.buf.element_size())
            self.gather_work = all_gather_single(self.buf, self.shard, group=self.group, async_op=True)

    def wait(self):
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None

    def free(self):
        self.wait()
        self.buf.untyped_storage().resize_(0)  # every parameter view now has no bytes

    def reduce(self):
        """Pack the gradients into one [N] (zeros where a parameter has none: every rank hands over the
        same sizes) and sum it over the group: stage 0 all-reduces it, the others reduce-scatter it to
        my slice [n]. Returns (result, work, input)."""
        g = torch.zeros(self.N, dtype=self.master.dtype, device=self.master.device)
        for i, (p, view) in enumerate(zip(self.params, self.views(g))):
            if p.grad is not None:
                view.copy_(p.grad)
                self.used[i] = 1
                if self.stage >= 2:
                    p.grad = None  # stages 2-3 keep only the reduced slice
        if self.stage == 0:
            return g, None if self.alone else dist.all_reduce(g, group=self.group, async_op=True), g
        out = g.new_empty(self.n)
        return out, reduce_scatter_single(out, g, group=self.group, async_op=True), g


def _my_slice(u, entries, init_fn):
    """A new unit's master slice [n], made from my part of each parameter only: a meta-device model's
    from init_fn, on the device our collectives use, in at least fp32 (a bf16 model gets an fp32 master)."""
    p0, lo = entries[0][2], u.r * u.n
    master = torch.zeros(u.n, dtype=torch.promote_types(p0.dtype, torch.float32) if p0.is_meta else p0.dtype,
                         device=collective_device(u.group) if p0.is_meta else p0.device)
    for (i, a, b), off in [(s, u.offsets[s[0]]) for s in u.spans()]:
        names, _, p = entries[i]
        full = init_fn(names[0], p.shape) if p.is_meta else p.detach()
        master[a:b] = full.reshape(-1)[lo + a - off:lo + b - off].to(master.device)
    return master


def _repoint(entry, view):
    """Every holder of the parameter now holds `view` (of buf). `.data`-made views get their own version
    counter, so refilling buf (stage 3) does not trip autograd's check on saved tensors."""
    p = nn.Parameter(view)
    for module, attr in entry[1]:
        module._parameters[attr] = p
    return p
