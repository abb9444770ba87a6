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
    if tied:  # one HF matrix used twice: its gradient is the sum of the course's two
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
    with pytest.raises(ValueError, match="not 'gpt2'"):
        config_from_hf(transformers.GPT2Config())
