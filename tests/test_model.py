"""model.py and data.py: sizes, determinism, dtypes, the MoE reference, rotary positions."""
import math

import pytest
import torch
import torch.nn.functional as F

from lab.data import get_batch, load_corpus
from lab.model import (CONFIGS, apply_rope, build_model, flops_per_token, get_config,
                   init_tensor, num_params, rope_cos_sin)


@pytest.mark.parametrize("cfg", [get_config("tiny"), get_config("small"),
                                 get_config("tiny", n_experts=4, top_k=2)])
def test_num_params_matches_the_model(cfg):
    model = build_model(cfg)
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())


def test_small_is_about_10M_and_flops_formula():
    cfg = get_config("small")
    assert 8e6 < num_params(cfg) < 12e6
    n = num_params(cfg) - cfg.vocab_size * cfg.dim
    assert flops_per_token(cfg, 256) == 6 * n + 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 256  # causal
    moe = get_config("tiny", n_experts=8, top_k=2)
    dense_like = num_params(moe, active=True)
    assert dense_like == num_params(moe) - 6 * 3 * moe.dim * moe.ffn_dim * moe.n_layers


def test_deterministic_for_a_seed():
    a, b, c = build_model("tiny", seed=1), build_model("tiny", seed=1), build_model("tiny", seed=2)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        assert torch.equal(pa, init_tensor(a.cfg, n, tuple(pa.shape), seed=1)), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc), n
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(a(x), b(x))


def test_meta_model_then_init_equals_eager():
    cfg = get_config("tiny")
    big = build_model("large", device="meta", dtype=torch.bfloat16)  # ~1B parameters, no memory
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in big.parameters())
    m = build_model(cfg, device="meta").to_empty(device="cpu")
    m.init_weights(seed=0)
    for (n, p), q in zip(m.named_parameters(), build_model(cfg).parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtypes_forward_backward(dtype):
    model = build_model("tiny", dtype=dtype)
    x = torch.randint(0, 256, (2, 16))
    loss = model(x, torch.roll(x, -1, 1))
    assert loss.dtype in (torch.float32, torch.float64)
    assert abs(loss.item() - math.log(256)) < 0.1  # near-uniform predictions at init
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in model.parameters())


def test_float64_matches_float32_closely():
    x = torch.randint(0, 256, (2, 16))
    l32 = build_model("tiny", dtype=torch.float32)(x, x).item()
    l64 = build_model("tiny", dtype=torch.float64)(x, x).item()
    assert abs(l32 - l64) < 1e-5


def test_gqa_attention_equals_repeated_kv():
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    from lab.model import SDPA
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(SDPA()(q, k, v), want)


def test_rope_depends_only_on_relative_position():
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([pq]), 8, 10000.0, torch.float64)
        ck, sk = rope_cos_sin(torch.tensor([pk]), 8, 10000.0, torch.float64)
        return (apply_rope(q.double(), cq, sq) * apply_rope(k.double(), ck, sk)).sum().item()

    assert score(5, 3) == pytest.approx(score(12, 10), abs=1e-12)
    assert score(5, 3) != pytest.approx(score(5, 4), abs=1e-6)


def test_moe_reference_dropless_capacity_and_aux():
    torch.manual_seed(0)
    cfg = get_config("tiny", n_experts=4, top_k=2)
    moe = build_model(cfg).layers[0].mlp
    x = torch.randn(2, 8, cfg.dim)
    out = moe(x)
    # dense recomputation: every token through all experts, weighted by its top-k gates
    flat = x.reshape(-1, cfg.dim)
    probs = F.softmax(moe.router(flat), -1)
    w, e = probs.topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    want = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(2):
            want[t] += w[t, j] * moe.expert(int(e[t, j]), flat[t:t + 1])[0]
    torch.testing.assert_close(out.reshape(-1, cfg.dim), want)
    assert moe.dropped == 0 and moe.tokens_per_expert.sum() == 32
    # capacity: C = ceil(16 * 2 / 4 * 0.5) = 4 per expert, so at most 16 of 32 assignments kept
    moe.capacity_factor = 0.5
    moe(x)
    assert moe.capacity(16) == 4 and moe.tokens_per_expert.max() <= 4
    assert moe.dropped == 32 - int(moe.tokens_per_expert.sum()) > 0
    # uniform router probabilities: the aux loss equals its coefficient
    with torch.no_grad():
        moe.router.weight.zero_()
    moe.capacity_factor = None
    moe(x)
    assert moe.aux_loss.item() == pytest.approx(cfg.aux_loss_coef)


def test_moe_model_trains():
    model = build_model(get_config("tiny", n_experts=4, top_k=2))
    x = torch.randint(0, 256, (2, 16))
    loss = model(x, x)
    loss.backward()
    assert model.layers[0].mlp.router.weight.grad.abs().sum() > 0


def test_config_errors():
    with pytest.raises(ValueError, match="n_kv_heads"):
        get_config("tiny", n_kv_heads=3)
    with pytest.raises(ValueError, match="top_k"):
        get_config("tiny", n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="unknown model"):
        get_config("huge")
    assert set(CONFIGS) >= {"tiny", "small"}


def test_data_batches_deterministic_and_sliced_by_rank():
    tokens = load_corpus()
    assert tokens.dtype == torch.long and tokens.max() < 256 and len(tokens) > 1_000_000
    x, y = get_batch(tokens, step=3, global_batch=8, seq_len=32, seed=0)
    x2, _ = get_batch(tokens, step=3, global_batch=8, seq_len=32, seed=0)
    assert torch.equal(x, x2) and x.shape == (8, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert not torch.equal(x, get_batch(tokens, step=4, global_batch=8, seq_len=32)[0])
    parts = [get_batch(tokens, 3, 8, 32, 0, dp_rank=r, dp_size=4)[0] for r in range(4)]
    assert torch.equal(torch.cat(parts), x)
    with pytest.raises(ValueError, match="not divisible"):
        get_batch(tokens, 0, 6, 32, dp_size=4)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus("/no/such/file.txt")


# ---- the GPT-family options ---------------------------------------------------------------------------

LLAMA_NAMES = ["tok_embeddings.weight"] + [f"layers.{i}.{n}.weight" for i in range(2) for n in (
    "attn_norm", "attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp_norm", "mlp.w1", "mlp.w3", "mlp.w2")] + [
    "norm.weight", "output.weight"]


def test_the_defaults_are_the_llama_model():
    """The options' defaults leave the model as it was: the same parameters, in the same order, untied."""
    model = build_model("tiny")
    assert [n for n, _ in model.named_parameters()] == LLAMA_NAMES
    assert model.output.weight is not model.tok_embeddings.weight and not hasattr(model, "pos_embeddings")


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-bloom"])
def test_gpt_family_options_sizes_ties_and_meta(name):
    """num_params is the model's (a tied matrix once, padded rows in); the tied head IS the embedding, on the meta
    device too, and after to_empty + tie_weights + init the same values as built eagerly; a padded vocabulary's
    logits are cut to vocab_size, and its padded rows get no gradient (no token uses them, no loss sees them)."""
    for cfg in (get_config(name), get_config(name, n_experts=4), get_config(name, norm_bias=False, bias=False,
                                                                            gelu_approximate="none")):
        model = build_model(cfg)
        assert num_params(cfg) == sum(p.numel() for p in model.parameters()), cfg
        assert model.output.weight is model.tok_embeddings.weight
    cfg = get_config(name)
    meta = build_model(cfg, device="meta")
    assert meta.output.weight is meta.tok_embeddings.weight
    m = meta.to_empty(device="cpu")
    m.tie_weights()
    m.init_weights(seed=0)
    for (n, p), q in zip(m.named_parameters(), build_model(cfg).parameters()):
        assert torch.equal(p, q), n
    model = build_model(cfg, dtype=torch.float64)
    x = torch.randint(0, 256, (2, 16))
    assert model(x).shape == (2, 16, cfg.vocab_size)
    model(x, torch.roll(x, -1, 1)).backward()
    grad = model.tok_embeddings.weight.grad
    assert grad[cfg.vocab_size:].abs().sum() == 0 and grad[:cfg.vocab_size].abs().sum() > 0
    assert (cfg.padded_vocab > cfg.vocab_size) == (name == "tiny-gpt2")
    flops = 6 * (num_params(cfg) - cfg.max_seq_len * cfg.dim * (cfg.positions == "learned")) \
        + 6 * cfg.n_layers * cfg.dim * 16   # tied: the head's matmul counts; the lookups do not
    assert flops_per_token(cfg, 16) == flops


def test_named_gpt_family_shapes_have_their_published_sizes():
    """GPT-2, GPT-2 XL, GPT-3 175B (at GPT-2's vocabulary), MPT-7B and BLOOM: the course's count with the padded
    rows left out is the published one, and transformers' own model of the same config (built on the meta device,
    nothing downloaded) has exactly as many parameters; the course's model has num_params."""
    import transformers
    from dataclasses import replace
    published = {"gpt2": (124_439_808, transformers.GPT2Config()),
                 "gpt2-xl": (1_557_611_200, transformers.GPT2Config(n_embd=1600, n_layer=48, n_head=25)),
                 "gpt3-175b": (174_604_259_328, transformers.GPT2Config(n_embd=12288, n_layer=96, n_head=96,
                                                                         n_positions=2048)),
                 "mpt-7b": (6_649_286_656, transformers.MptConfig(d_model=4096, n_heads=32, n_layers=32,
                                                                  expansion_ratio=4, max_seq_len=2048,
                                                                  vocab_size=50432, no_bias=True)),
                 "bloom-176b": (176_247_271_424, transformers.BloomConfig(vocab_size=250880, hidden_size=14336,
                                                                          n_layer=70, n_head=112))}
    for name, (count, config) in published.items():
        cfg = get_config(name)
        assert num_params(replace(cfg, vocab_multiple=1)) == count, name
        with torch.device("meta"):
            theirs = transformers.AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in theirs.parameters()) == count, name
        assert sum(p.numel() for p in build_model(cfg, device="meta").parameters()) == num_params(cfg), name
    assert get_config("gpt2").padded_vocab == 50304  # nanoGPT's, a multiple of 128: tp up to 128 splits it


def test_option_errors():
    for bad, word in ((dict(norm="batch"), "norm='batch'"), (dict(positions="sinusoidal"), "positions"),
                      (dict(norm_bias=True), "norm_bias=True needs norm='layer'"), (dict(mlp="relu"), "mlp='relu'"),
                      (dict(vocab_multiple=0), "vocab_multiple=0")):
        with pytest.raises(ValueError, match=word):
            get_config("tiny", **bad)
    get_config("tiny", positions="alibi", dim=36, n_heads=4, n_kv_heads=2)  # head_dim 9: odd is fine without rope
