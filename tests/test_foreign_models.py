"""The lessons on models nobody here wrote: transformers' Llama (tied and untied embeddings, grouped-query
attention), GPT-2 and Mixtral (a mixture of experts some ranks' tokens skip), each from a tiny config, and an
nn.Sequential with a frozen layer and a layer used twice — under DDP (ddp.py), ZeRO 1-3 (fsdp.shard_model),
ZeRO-1 over parameters (fsdp.shard_optimizer) and HSDP (hsdp.shard_hybrid), on 2 and 4 ranks, in float64,
against one process. Hugging Face models return a ModelOutput (a dict): the loss is read from it, and
shard_model finds their blocks by its documented rule (fsdp.default_units), no units named. Every rank is
checked; each world size is one spawned group of ranks.

Also: reading a ZeRO-3 model's parameters raises one error naming full_state_dict (never a crash); torch's own
clip_grad_norm_ on a sharded model does NOT see the global gradient (what fsdp.shard_model's docstring says)
while opt.clip_grad_norm_ does; units= in every form it takes.
"""
import functools
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lab.baseline import max_diff, single_process
from harness import run_ranks

STEPS, B, S, V, LR, TOL = 3, 4, 8, 64, 1e-2, 1e-10
MODELS = ("llama_tied", "llama", "gpt2", "mixtral", "sequential")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero1_params", "hsdp")


def build(name, seed=0):
    """The model in float64 from a tiny config (no download), initialised from `seed`."""
    torch.manual_seed(seed)
    if name == "sequential":  # a frozen layer and one Linear used twice (the same module at two places)
        twice = nn.Linear(16, 16)
        model = nn.Sequential(nn.Embedding(V, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                              twice, nn.Tanh(), twice, nn.Linear(16, V))
        model[3].requires_grad_(False)
        return model.double()
    import transformers
    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=V, bos_token_id=0, eos_token_id=1, pad_token_id=None, attn_implementation="eager")
    if name.startswith("llama"):
        cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       tie_word_embeddings=name == "llama_tied", **common)
        return transformers.LlamaForCausalLM(cfg).double()
    if name == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=1, max_position_embeddings=32,
                                         experts_implementation="eager", **common)  # (grouped_mm: no float64)
        return transformers.MixtralForCausalLM(cfg).double()
    cfg = transformers.GPT2Config(n_positions=32, n_embd=16, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, **common)
    return transformers.GPT2LMHeadModel(cfg).double()


def loss_fn(model, x):
    """The mean next-token loss of a batch of rows x [b, S] (equal rows per rank: the ranks' mean is the global)."""
    if isinstance(model, nn.Sequential) or isinstance(getattr(model, "module", None), nn.Sequential):
        logits = model(x)  # [b, S, V]
    else:  # a ModelOutput (a dict): the logits are one of its tensors (its own .loss is computed in fp32)
        logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (B, S), generator=g) for _ in range(STEPS)]


def units_of(name, model, strategy):
    """None: the documented rule finds a transformer's blocks. The Sequential names its own: each Linear a unit
    by class (stage 1), or a list whose second item, two modules that run in turn, is one unit (stages 2-3)."""
    if name != "sequential":
        return None
    return (nn.Linear,) if strategy == "zero1" else [model[0], [model[1], model[3]], model[5], model[8]]


def run_case(name, strategy, mesh):
    """One model under one strategy on this rank: the global losses and the full final state."""
    from ddp import BucketedDDP
    from fsdp import shard_model, shard_optimizer
    from hsdp import shard_hybrid
    P, r = dist.get_world_size(), dist.get_rank()
    model = build(name)
    if strategy == "ddp":
        wrapped = BucketedDDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    elif strategy == "zero1_params":
        wrapped, opt = model, shard_optimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    elif strategy == "hsdp":
        wrapped, opt = model, shard_hybrid(model, mesh, units=units_of(name, model, strategy), lr=LR)
    else:
        wrapped, opt = model, shard_model(model, int(strategy[-1]), units=units_of(name, model, strategy), lr=LR)
    losses = []
    for x in batches():
        loss = loss_fn(wrapped, x[r * B // P:(r + 1) * B // P])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / P)
    state = model.state_dict() if strategy in ("ddp", "zero1_params") else opt.full_state_dict()
    return dict(losses=losses, state={k: v.clone() for k, v in state.items()})


def reading_after_stage3():
    """After shard_model(model, 3): what reading the model's own parameters does, per way of reading."""
    from fsdp import shard_model
    model = build("llama")
    opt = shard_model(model, 3, lr=LR)
    loss_fn(model, batches()[0][:1]).backward()
    opt.step()
    out = {}
    for how, read in dict(state_dict=lambda: model.state_dict(),
                          save=lambda: torch.save(model.state_dict(), io.BytesIO()),
                          print=lambda: print(model.model.layers[0].self_attn.q_proj.weight),
                          arithmetic=lambda: model.lm_head.weight.sum()).items():
        try:
            read()
            out[how] = "no error"
        except RuntimeError as e:
            out[how] = str(e)
    out["numel"] = sum(p.numel() for p in model.parameters())  # metadata stays readable
    sd = opt.full_state_dict()  # the true values, on every rank; saved and loaded back as any state dict
    f = io.BytesIO()
    torch.save(sd, f)
    f.seek(0)
    out["loaded"] = torch.load(f, weights_only=True)
    return out


def clipping(stage):
    """Global gradient norms after one backward: torch's clip_grad_norm_ on the model's parameters, then
    opt.clip_grad_norm_ (the same max_norm, large: nothing is scaled)."""
    from fsdp import shard_model
    P, r = dist.get_world_size(), dist.get_rank()
    model = build("llama")
    opt = shard_model(model, stage, lr=LR)
    x = batches()[0]
    loss_fn(model, x[r * B // P:(r + 1) * B // P]).backward()
    theirs = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1e9)
    return dict(torch=float(theirs), ours=float(opt.clip_grad_norm_(1e9)))


class _Box:  # an output our hooks cannot look into: neither a tensor, a sequence, a dict nor a dataclass
    def __init__(self, t):
        self.t = t


class _BoxedLinear(nn.Linear):
    def forward(self, x):
        return _Box(super().forward(x))


class _Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_BoxedLinear(4, 4)])

    def forward(self, x):
        return self.layers[0](x)


def hidden_output(stage):
    """A model (and its one unit) whose output hides its tensor: step() raises one clear error, not a
    misleading 'arrived after its unit was reduced' (and at stage 3 nothing reads freed memory)."""
    from fsdp import shard_model
    model = _Opaque().double()
    opt = shard_model(model, stage, lr=LR)  # the rule finds layers.0; nothing is left to the root
    model(torch.ones(2, 4, dtype=torch.float64)).t.sum().backward()
    try:
        opt.step()
        return "no error"
    except RuntimeError as e:
        return str(e)


def on_ranks():
    from mesh import Mesh
    P = dist.get_world_size()
    mesh = Mesh(dp_replicate=2, dp_shard=P // 2)  # HSDP: 2 replicas of P/2 shards
    out = {(m, s): run_case(m, s, mesh) for m in MODELS for s in STRATEGIES}
    out["reading"] = reading_after_stage3()
    out["clip"] = {stage: clipping(stage) for stage in (1, 2, 3)}
    out["hidden"] = {stage: hidden_output(stage) for stage in (2, 3)}
    return out


@functools.cache
def ranks(P):
    return run_ranks(on_ranks, P, timeout=240)


@functools.cache
def reference(name):
    ref = single_process(build(name), batches(), lr=LR, loss_fn=loss_fn)
    return dict(losses=ref["losses"], state=ref["model"].state_dict())


@pytest.fixture(scope="module", params=[2, 4])
def world(request):
    return request.param, ranks(request.param)


@pytest.mark.parametrize("name", MODELS)
def test_foreign_model_equals_one_process(world, name):
    """Every strategy, every rank: the single-process losses and final parameters (tied ones under both names)."""
    P, results = world
    ref, worst = reference(name), {}
    for rank, res in enumerate(results):
        for strategy in STRATEGIES:
            got = res[(name, strategy)]
            worst[(rank, strategy)] = max(max_diff(got["state"], ref["state"]),
                                          max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])))
    for strategy in STRATEGIES:
        d = max(v for (_, s), v in worst.items() if s == strategy)
        print(f"{name:11s} {strategy:13s} P={P}: max |diff| to one process {d:.1e}")
    key = max(worst, key=worst.get)
    assert worst[key] < TOL, f"{name} on {P} ranks: rank {key[0]} {key[1]} is {worst[key]:.2e} off"
    assert all(abs(a - b) > 1e-6 for a, b in zip(ref["losses"], ref["losses"][1:])), "the model did not train"


def test_reading_a_stage3_model_raises_one_clear_error(world):
    P, results = world
    want = reference("llama")  # (the one-process run's first step is not this one's: check the keys and shapes)
    for rank, res in enumerate(results):
        got = res["reading"]
        for how in ("state_dict", "save", "print", "arithmetic"):
            assert "sharded by ZeRO-3" in got[how] and "full_state_dict" in got[how], (rank, how, got[how])
        assert got["numel"] == sum(p.numel() for p in build("llama").parameters())
        assert {k: v.shape for k, v in got["loaded"].items()} == {k: v.shape for k, v in want["state"].items()}


def test_torch_clip_grad_norm_sees_only_local_gradients_ours_the_global(world):
    """What shard_model's docstring says: torch.nn.utils.clip_grad_norm_ on a sharded model's parameters sees,
    under stage 1, this rank's unaveraged gradient, under stages 2-3 nothing at all (the gradients live in the
    optimizer's flat shards); opt.clip_grad_norm_ gives one process's norm."""
    P, results = world
    model = build("llama")
    loss_fn(model, batches()[0]).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    for rank, res in enumerate(results):
        for stage, got in res["clip"].items():
            assert abs(got["ours"] - want) < 1e-10 * want, (rank, stage, got, want)
            if stage == 1:
                assert abs(got["torch"] - want) > 1e-3 * want, (rank, stage, got, want)  # local: not the global
            else:
                assert got["torch"] == 0.0, (rank, stage, got)  # no p.grad left to see


def test_units_in_every_form_and_a_clear_error_without_blocks():
    """units= takes a class, a tuple or list of classes, a list of submodules (an item may be a list: one unit);
    with none named, the rule finds a transformer's blocks, embedding and norm + head; a model with no
    nn.ModuleList gets a ValueError naming units= — never one silent unit of everything."""
    from fsdp import default_units, unit_groups
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    llama = build("llama")
    blocks = [(b,) for b in llama.model.layers]
    for form in (LlamaDecoderLayer, (LlamaDecoderLayer,), [LlamaDecoderLayer], list(llama.model.layers)):
        assert unit_groups(llama, form) == blocks, form
    assert default_units(llama) == [(llama.model.embed_tokens,), *blocks, (llama.model.norm, llama.lm_head)]
    gpt2 = build("gpt2")
    blocks = [(b,) for b in gpt2.transformer.h]
    assert default_units(gpt2) == [(gpt2.transformer.wte,), (gpt2.transformer.wpe,), *blocks,
                                   (gpt2.transformer.ln_f, gpt2.lm_head)]
    seq = build("sequential")
    assert unit_groups(seq, [seq[1], [seq[5], seq[8]]]) == [(seq[1],), (seq[5], seq[8])]
    with pytest.raises(ValueError, match="units="):
        default_units(seq)
    with pytest.raises(ValueError, match="no submodule"):
        unit_groups(seq, nn.Conv1d)
    for bad in ([seq[1], seq[1]], [nn.Linear(2, 2)], ["layers"], [seq]):
        with pytest.raises(ValueError):
            unit_groups(seq, bad)


def test_an_output_the_hooks_cannot_see_gets_a_clear_error(world):
    """Any tensor, tuple, list, dict or dataclass output is seen (the models above return ModelOutput dicts);
    an object that hides its tensors gets one error saying so, on every rank, not a misleading 'late' one."""
    P, results = world
    for rank, res in enumerate(results):
        for stage, msg in res["hidden"].items():
            assert "no backward hook of the sharded model ran" in msg and "dict" in msg, (rank, stage, msg)
