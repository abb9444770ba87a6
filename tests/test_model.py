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
