"""The course's model is Hugging Face's Llama (and Mixtral): the same weights give the same logits and the same
gradients, float64, to 1e-10; the conversion (lab/hf.py) round-trips and survives save_pretrained/from_pretrained.

Precision: transformers computes three things in float32 even in a float64 model — RMSNorm's normalisation, the
rotary angles (inv_freq, cos, sin) and Mixtral's router softmax. `float64_islands` lifts exactly those to the
input's dtype (the course's rule: at least fp32, float64 stays float64) for the 1e-10 comparisons; in float32 the
lifted code is bit-for-bit transformers' own (checked). Unlifted, the float64 models differ by those islands'
rounding only: within BAND, which each deliberate mistake (a swapped gate/up, the default theta or eps, Meta's
interleaved rotary pairs) misses by orders of magnitude (checked).
"""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import transformers  # (requirements.txt installs it: the reference is never skipped)
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

from lab.hf import config_from_hf, hf_config, to_course, to_hf  # noqa: E402
from lab.model import build_model  # noqa: E402

EXACT = 1e-10   # float64, islands lifted
BAND = 1e-5     # float64, transformers' float32 islands left in (measured: ~1e-7)
B, S = 2, 24
CAUSAL_LM = {"llama": transformers.LlamaForCausalLM, "mixtral": transformers.MixtralForCausalLM}


def llama_config(tied=False, vocab=96):
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                    rope_parameters={"rope_type": "default", "rope_theta": 5e4}, rms_norm_eps=1e-6,
                                    tie_word_embeddings=tied)


def mixtral_config(vocab=96):
    return transformers.MixtralConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                      num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
                                      rope_parameters={"rope_type": "default", "rope_theta": 5e4},
                                      experts_implementation="eager")  # its grouped_mm takes no float64 on CPU


def hf_model(config, seed=0):
    """A float64 Hugging Face model with random weights of unit-scale activations (norm weights not 1, so a
    swapped norm shows)."""
    torch.manual_seed(seed)
    model = CAUSAL_LM[config.model_type](config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model.to(torch.float64)


def course_model(cfg, state):
    model = build_model(cfg, dtype=torch.float64)
    model.load_state_dict(state, strict=True)
    return model


def tokens(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (B, S), generator=g), torch.randint(vocab, (B, S), generator=g)


# ---- transformers' float32 islands, lifted to the input's dtype ----------------------------------------------

def _rmsnorm(self, x):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # was: x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * xf.to(x.dtype)


def _rotary(self, x, position_ids):
    work = torch.promote_types(x.dtype, torch.float32)  # was: inv_freq built in float32, angles in float32
    dim, theta = 2 * self.inv_freq.numel(), self.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=work) / dim))
    freqs = position_ids[..., None].to(work) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _router(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # was: logits.float()
    top, index = torch.topk(probs, self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), index


@pytest.fixture
def float64_islands(monkeypatch):
    def lift():
        for mod, prefix in ((modeling_llama, "Llama"), (modeling_mixtral, "Mixtral")):
            monkeypatch.setattr(getattr(mod, prefix + "RMSNorm"), "forward", _rmsnorm)
            monkeypatch.setattr(getattr(mod, prefix + "RotaryEmbedding"), "forward", _rotary)
        monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", _router)
    return lift


def test_lifting_the_islands_changes_only_precision(float64_islands, monkeypatch):
    """In float32 the lifted code is transformers' own, bit for bit; in float64 it moves the logits by float32
    rounding only."""
    for config in (llama_config(False), mixtral_config()):
        model, (x, _) = hf_model(config), tokens(config.vocab_size)
        with torch.no_grad():
            before = {dt: model.to(dt)(x).logits for dt in (torch.float32, torch.float64)}
            float64_islands()
            after = {dt: model.to(dt)(x).logits for dt in (torch.float32, torch.float64)}
            monkeypatch.undo()
        assert torch.equal(before[torch.float32], after[torch.float32]), config.model_type
        moved = (before[torch.float64] - after[torch.float64]).abs().max().item()
        assert 0 < moved < BAND, (config.model_type, moved)


def _compare(hf, course, cfg, tied, x, y):
    """(max logit difference, max gradient difference over every Hugging Face parameter), one loss on both."""
    logits = {}
    for name, model in (("hf", hf), ("course", course)):
        model.zero_grad()
        out = model(x)
        logits[name] = out.logits if name == "hf" else out
        F.cross_entropy(logits[name].flatten(0, 1), y.flatten()).backward()
    grads = {n: p.grad for n, p in course.named_parameters()}
    if tied and "output.weight" in grads:  # one HF matrix used twice: the sum of the course's two (Llama's copies)
        grads["tok_embeddings.weight"] = grads["tok_embeddings.weight"] + grads.pop("output.weight")
        grads["output.weight"] = torch.zeros_like(grads["tok_embeddings.weight"])  # no HF parameter of its own
    expect = to_hf(grads, cfg)
    hf_params = dict(hf.named_parameters())
    assert ("lm_head.weight" in hf_params) != tied and set(hf_params) <= set(expect)
    grad_diff = max((hf_params[n].grad - expect[n]).abs().max().item() for n in hf_params)
    return (logits["hf"] - logits["course"]).abs().max().item(), grad_diff


@pytest.mark.parametrize("kind", ["llama-untied", "llama-tied", "mixtral"])
def test_same_logits_and_gradients_as_transformers(kind, float64_islands):
    config = mixtral_config() if kind == "mixtral" else llama_config(kind == "llama-tied")
    tied = kind == "llama-tied"
    hf = hf_model(config)
    cfg = config_from_hf(config)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.n_kv_heads, cfg.n_experts) == (5e4, 1e-6, 2, 4 * (kind == "mixtral"))
    state = to_course(hf.state_dict(), cfg)
    head, embedding = state["output.weight"], state["tok_embeddings.weight"]
    assert torch.equal(head, embedding) == tied and head.data_ptr() != embedding.data_ptr()  # tied: two copies
    course = course_model(cfg, state)
    x, y = tokens(config.vocab_size)
    logit_band, grad_band = _compare(hf, course, cfg, tied, x, y)  # transformers as it is
    assert logit_band < BAND and grad_band < BAND, (logit_band, grad_band)
    float64_islands()
    logit_diff, grad_diff = _compare(hf, course, cfg, tied, x, y)  # with its float32 islands in float64
    assert logit_diff < EXACT and grad_diff < EXACT, (logit_diff, grad_diff)
    assert logit_diff < logit_band  # the islands were all of the difference
    if kind == "mixtral":
        assert course.layers[0].mlp.dropped == 0 and course.layers[0].mlp.tokens_per_expert.min() > 0


def test_mixtral_loss_and_its_balancing_loss_on_one_layer():
    """Mixtral's training loss (labels shifted inside, router_aux_loss_coef x its balancing loss) is the course's
    loss (targets given shifted, aux_loss_coef = k x router_aux_loss_coef) — on one layer; over several, Mixtral
    pools every layer's routing statistics before the product, the course adds one term per layer. Within BAND:
    transformers computes this loss in float32."""
    config = mixtral_config()
    config.num_hidden_layers, config.router_aux_loss_coef, config.output_router_logits = 1, 0.05, True
    hf, cfg = hf_model(config), config_from_hf(config)
    course = course_model(cfg, to_course(hf.state_dict(), cfg))
    x, labels = tokens(config.vocab_size)
    targets = torch.cat([labels[:, 1:], torch.full((B, 1), -100)], dim=1)  # HF predicts labels[t+1] at t
    with torch.no_grad():
        out, ours = hf(x, labels=labels), course(x, targets)
        aux = course.aux_loss()
    assert abs(out.loss.item() - ours.item()) < BAND
    assert abs(config.router_aux_loss_coef * out.aux_loss.item() - aux.item()) < BAND and aux > 0.05


def _interleave_rows(w, head_dim):
    """q/k rows in Meta's pairing (x_2i, x_2i+1) instead of (x_i, x_i+D/2): the permutation HF's script undoes."""
    return w.view(-1, 2, head_dim // 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


@pytest.mark.parametrize("mistake", ["w1 <-> w3", "default rope_theta", "default norm_eps", "Meta's rotary pairs"])
def test_the_band_catches_a_real_mistake(mistake):
    """Unlifted, the float64 models agree within BAND; each mistake below misses it by far."""
    config = llama_config(False)
    hf, cfg = hf_model(config), config_from_hf(config)
    state = to_course(hf.state_dict(), cfg)
    x, _ = tokens(config.vocab_size)
    if mistake == "w1 <-> w3":
        state["layers.1.mlp.w1.weight"], state["layers.1.mlp.w3.weight"] = (state["layers.1.mlp.w3.weight"],
                                                                            state["layers.1.mlp.w1.weight"])
    elif mistake == "default rope_theta":
        cfg = replace(cfg, rope_theta=1e4)
    elif mistake == "default norm_eps":
        cfg = replace(cfg, norm_eps=1e-5)
    else:
        for w in ("wq", "wk"):
            state[f"layers.0.attn.{w}.weight"] = _interleave_rows(state[f"layers.0.attn.{w}.weight"], cfg.head_dim)
    with torch.no_grad():
        diff = (hf(x).logits - course_model(cfg, state)(x)).abs().max().item()
    assert diff > 100 * BAND, (mistake, diff)


@pytest.mark.parametrize("kind", ["llama-untied", "llama-tied", "mixtral"])
def test_round_trips_and_save_pretrained(kind, tmp_path, float64_islands):
    """course -> HF -> course is the identity; HF -> course -> HF too; from_pretrained of what save_pretrained
    wrote from to_hf's state dict gives the course's logits; to_course reads the saved files as they are."""
    from safetensors.torch import load_file
    float64_islands()
    tied = kind == "llama-tied"
    config = mixtral_config() if kind == "mixtral" else llama_config(tied)
    cfg = config_from_hf(config)
    course = build_model(cfg, seed=3, dtype=torch.float64)
    if tied:
        with torch.no_grad():
            course.output.weight.copy_(course.tok_embeddings.weight)
    state = course.state_dict()
    hf_state = to_hf(state, cfg, tied=tied)
    back = to_course(hf_state, cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)

    made = hf_config(cfg, tied=tied)
    made._experts_implementation = config._experts_implementation
    hf = CAUSAL_LM[config.model_type](made).to(torch.float64)
    hf.load_state_dict(hf_state, strict=True)
    again = to_hf(to_course(hf.state_dict(), cfg), cfg, tied=tied)
    assert again.keys() == hf.state_dict().keys() and all(torch.equal(again[k], v) for k, v in hf.state_dict().items())

    hf.save_pretrained(tmp_path)
    loaded = type(hf).from_pretrained(tmp_path, dtype=torch.float64,
                                      experts_implementation=config._experts_implementation)
    assert loaded.config.tie_word_embeddings == tied and config_from_hf(loaded.config) == cfg
    x, _ = tokens(cfg.vocab_size)
    with torch.no_grad():
        assert (loaded(x).logits - course(x)).abs().max().item() < EXACT
    files = load_file(tmp_path / "model.safetensors")  # tied: no lm_head.weight; Mixtral: saved per expert
    assert ("lm_head.weight" in files) != tied
    assert any(".block_sparse_moe.experts.0.w1." in k for k in files) == (kind == "mixtral")
    saved = to_course(files, cfg)
    assert all(torch.equal(saved[k], state[k]) for k in state)


def test_to_hf_refuses_a_tie_the_course_model_no_longer_has():
    cfg = config_from_hf(llama_config(True))
    state = build_model(cfg, dtype=torch.float64).state_dict()  # output and embedding initialised apart
    with pytest.raises(ValueError, match="tied=True, but tok_embeddings and output differ"):
        to_hf(state, cfg, tied=True)


def test_config_from_hf_refuses_what_the_course_cannot_express():
    bad = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                   mlp_bias=True, hidden_act="gelu", head_dim=16,
                                   rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError) as err:
        config_from_hf(bad)
    for name in ("attention_bias", "mlp_bias", "hidden_act", "head_dim", "rope_parameters"):
        assert name in str(err.value), name
    with pytest.raises(ValueError, match="sliding_window"):
        config_from_hf(transformers.MixtralConfig(hidden_size=32, num_attention_heads=4, sliding_window=16))
    with pytest.raises(ValueError, match="not 'bloom'"):
        config_from_hf(transformers.BloomConfig())
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx.*activation_function"):
        config_from_hf(transformers.GPT2Config(scale_attn_by_inverse_layer_idx=True, activation_function="relu"))


# ---- GPT-2, and the GPT-family options against MPT's and BLOOM's blocks -------------------------------------------

def gpt2_config(tied=True, vocab=257, act="gelu_new"):
    """GPT-2 at tiny's size; an odd vocabulary like GPT-2's (the course pads it to 384 rows)."""
    return transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                   tie_word_embeddings=tied, activation_function=act, bos_token_id=None,
                                   eos_token_id=None)


def gpt2_model(config, seed=0):
    """A float64 GPT2LMHeadModel with random weights (norms not 1, biases not 0), in eval mode: no dropout."""
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "ln" in name and name.endswith("weight") else
                    torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1 * torch.randn_like(p))
    return model.to(torch.float64).eval()


@pytest.mark.parametrize("tied, act", [(True, "gelu_new"), (False, "gelu")])
def test_gpt2_same_logits_gradients_round_trips_and_save_pretrained(tied, act, tmp_path):
    """GPT-2 (tied, tanh GELU; untied, exact GELU) is the course's model with GPT-2's options: the same logits and
    gradients in float64 to 1e-10 — transformers computes GPT-2 in the model's dtype throughout, no island to lift.
    A tied checkpoint loads tied (one matrix, its gradient the sum of both uses); the padded vocabulary's rows (257
    -> 384) get no gradient and never reach the Hugging Face side. course -> HF -> course is the identity; from_pretrained
    of what save_pretrained wrote from to_hf's state dict gives the course's logits; to_course reads the files."""
    from safetensors.torch import load_file
    config = gpt2_config(tied, act=act)
    hf, cfg = gpt2_model(config), config_from_hf(config)
    assert (cfg.tie_embeddings, cfg.padded_vocab, cfg.gelu_approximate) == (tied, 384, "tanh" if tied else "none")
    course = course_model(cfg, to_course(hf.state_dict(), cfg))
    assert (course.output.weight is course.tok_embeddings.weight) == tied
    x, y = tokens(config.vocab_size)
    logit_diff, grad_diff = _compare(hf, course, cfg, tied, x, y)
    assert logit_diff < EXACT and grad_diff < EXACT, (logit_diff, grad_diff)
    assert course.tok_embeddings.weight.grad[257:].abs().sum() == 0

    state = build_model(cfg, seed=3, dtype=torch.float64).state_dict()
    hf_state = to_hf(state, cfg)
    assert set(hf_state) == set(hf.state_dict()) and hf_state["transformer.wte.weight"].shape == (257, 32)
    back = to_course(hf_state, cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k][:257], state[k][:257]) for k in state) and not back["tok_embeddings.weight"][257:].any()
    made = transformers.GPT2LMHeadModel(hf_config(cfg)).to(torch.float64).eval()
    made.load_state_dict(hf_state, strict=True)
    made.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float64)
    assert config_from_hf(loaded.config) == cfg
    mine = course_model(cfg, state)
    with torch.no_grad():
        assert (loaded(x).logits - mine(x)).abs().max().item() < EXACT
    files = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in files) != tied
    saved = to_course(files, cfg)
    assert all(torch.equal(saved[k][:257], state[k][:257]) for k in state)


def _mpt_or_bloom_state(hf, kind, L, H, heads):
    """A transformers MPT or BLOOM model's weights under the course's names (their fused q, k, v split: MPT's Wqkv
    q, k, v one after another, BLOOM's query_key_value head by head)."""
    sd, out, hd = hf.state_dict(), {}, H // heads
    if kind == "mpt":
        out.update({"tok_embeddings.weight": sd["transformer.wte.weight"], "norm.weight": sd["transformer.norm_f.weight"]})
        names = dict(attn_norm="norm_1", mlp_norm="norm_2", **{"attn.wo": "attn.out_proj", "mlp.w1": "ffn.up_proj",
                                                              "mlp.w2": "ffn.down_proj"})
        for i in range(L):
            p = f"transformer.blocks.{i}."
            out.update({f"layers.{i}.{k}.weight": sd[p + v + ".weight"] for k, v in names.items()})
            out.update(zip((f"layers.{i}.attn.w{n}.weight" for n in "qkv"), sd[p + "attn.Wqkv.weight"].chunk(3)))
    else:
        out.update({"tok_embeddings.weight": sd["transformer.word_embeddings.weight"]})
        names = dict(embed_norm="transformer.word_embeddings_layernorm", norm="transformer.ln_f")
        for i in range(L):
            p = f"transformer.h.{i}."
            names.update({f"layers.{i}.attn_norm": p + "input_layernorm", f"layers.{i}.mlp_norm": p + "post_attention_layernorm",
                          f"layers.{i}.attn.wo": p + "self_attention.dense", f"layers.{i}.mlp.w1": p + "mlp.dense_h_to_4h",
                          f"layers.{i}.mlp.w2": p + "mlp.dense_4h_to_h"})
            for kind_ in ("weight", "bias"):
                qkv = sd[p + f"self_attention.query_key_value.{kind_}"].view(heads, 3, hd, -1)
                out.update({f"layers.{i}.attn.w{n}.{kind_}": qkv[:, j].reshape(H, -1).squeeze(-1) for j, n in enumerate("qkv")})
        out.update({f"{k}.{b}": sd[f"{v}.{b}"] for k, v in names.items() for b in ("weight", "bias")})
    out["output.weight"] = out["tok_embeddings.weight"]
    return out


@pytest.mark.parametrize("kind", ["mpt", "bloom"])
def test_alibi_layernorm_and_gelu_options_are_mpts_and_blooms_blocks(kind):
    """MPT (ALiBi, LayerNorm without bias, exact GELU, no biases) and BLOOM (ALiBi, the embedding's LayerNorm,
    biases, tanh GELU) from transformers, 6 heads (ALiBi's slopes for a head count not a power of 2): the course's
    model with the same options and weights gives their logits within BAND (transformers makes ALiBi's slopes in
    float32)."""
    from lab.model import BLOOM, MPT, ModelConfig
    L, H, heads, V = 2, 48, 6, 96
    config = (transformers.MptConfig(d_model=H, n_heads=heads, n_layers=L, expansion_ratio=4, max_seq_len=64,
                                     vocab_size=V, no_bias=True) if kind == "mpt" else
              transformers.BloomConfig(vocab_size=V, hidden_size=H, n_layer=L, n_head=heads))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name and name.endswith("weight") else
                    torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1 * torch.randn_like(p))
    hf = hf.to(torch.float64).eval()
    cfg = ModelConfig(vocab_size=V, dim=H, n_layers=L, n_heads=heads, n_kv_heads=heads, ffn_dim=4 * H, max_seq_len=64,
                      **(MPT if kind == "mpt" else BLOOM))
    course = course_model(cfg, _mpt_or_bloom_state(hf, kind, L, H, heads))
    x, _ = tokens(V)
    with torch.no_grad():
        diff = (hf(x).logits - course(x)).abs().max().item()
    assert diff < BAND, diff
