"""The course's model and Hugging Face's Llama, Mixtral and GPT-2: configs and weights, both ways.

The course's Transformer (lab/model.py) is Llama: the same pre-norm block, RMSNorm, grouped-query attention,
SwiGLU and rotary positions; Mixtral is the same with a mixture of experts. A conversion is a renaming, and one
table holds it (HF_NAMES, Hugging Face's name -> the course's; i a layer):

    model.embed_tokens.weight                   tok_embeddings.weight
    model.layers.i.input_layernorm.weight       layers.i.attn_norm.weight
    model.layers.i.self_attn.q/k/v/o_proj       layers.i.attn.wq/wk/wv/wo
    model.layers.i.post_attention_layernorm     layers.i.mlp_norm
    model.layers.i.mlp.gate/up/down_proj        layers.i.mlp.w1/w3/w2                   (dense)
    model.layers.i.mlp.gate                     layers.i.mlp.router                     (Mixtral)
    model.layers.i.mlp.experts.gate_up_proj     layers.i.mlp.w1, w3 concatenated on dim 1: [E, 2F, H]
    model.layers.i.mlp.experts.down_proj        layers.i.mlp.w2                         [E, H, F]
    model.norm.weight                           norm.weight
    lm_head.weight                              output.weight

Conventions (tests/test_hf.py checks each):
  - rotary pairs: both rotate (x_j, x_{j+D/2}) (Hugging Face's rotate_half), so q and k need no permutation.
    Meta's original checkpoints pair (x_{2j}, x_{2j+1}); Hugging Face's conversion script permuted q/k's rows
    once, so Hugging Face's Llama checkpoints are already in this model's half-split order.
  - tied embeddings: the course's model has none (its lessons shard the embedding and the head apart). A tied
    checkpoint becomes an untied course model holding the same matrix twice: the same logits, and the tied
    weight's gradient is the sum of the two. to_hf(..., tied=True) refuses once the two have drifted apart.
  - Mixtral: softmax over all experts -> top-k -> renormalise, dropless: the course's MoE with capacity_factor
    None. Transformers holds the experts stacked (gate_up_proj, down_proj) but saves them per expert
    (block_sparse_moe.experts.j.w1/w2/w3, the course's own names); to_course reads both.
  - config_from_hf refuses what the course does not compute (biases, another activation, rope scaling, a
    sliding window, ...), with one ValueError naming each.

GPT-2 (GPT2LMHeadModel) is the course's model with GPT-2's options (lab/model.py's GPT2: LayerNorm with biases, a
tanh-GELU MLP, learned positions, biases, the head tied to the embedding), one table too (GPT2_NAMES):

    transformer.wte.weight [V, H]               tok_embeddings.weight [V', H]: V' = V padded to a multiple of 128
                                                (the rows beyond V: zeros in, never out, never seen by the loss)
    transformer.wpe.weight                      pos_embeddings.weight
    transformer.h.i.ln_1 / ln_2                 layers.i.attn_norm / mlp_norm                 (weight and bias)
    transformer.h.i.attn.c_attn [H, 3H]         layers.i.attn.wq, wk, wv: T, one after another along its columns
    transformer.h.i.attn.c_proj [H, H]          layers.i.attn.wo: T
    transformer.h.i.mlp.c_fc [H, 4H], c_proj    layers.i.mlp.w1, w2: T
    transformer.ln_f                            norm
    lm_head.weight                              (the tied embedding; output.weight if untied)
  T: GPT-2's Conv1D stores a weight [in, out], the transpose of a Linear's [out, in]; the biases concatenate as the
  weights' columns do. The hub's own checkpoint names its tensors without "transformer." and keeps each layer's
  causal-mask buffers (attn.bias, attn.masked_bias): both are read as they are, the buffers skipped. A tied GPT-2
  loads tied (one matrix, cfg.tie_embeddings), unlike a tied Llama, which keeps the course's two copies.

On disk (a model directory: config.json, model.safetensors or shards named by model.safetensors.index.json),
read_config gives the course's config and disk_map says where each course tensor lies in the files, so a rank
can read just its part (lab/checkpoint.py reads and writes the directories).
"""
from __future__ import annotations

import functools
import math
import os

import torch

from lab.model import GPT2, ModelConfig, build_model

HF_NAMES = {  # Hugging Face name -> course name; a tuple: the course's tensors concatenated on dim 1 (rows)
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.wv.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.wo.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.w2.weight",
    "model.layers.{i}.mlp.gate.weight": "layers.{i}.mlp.router.weight",
    "model.layers.{i}.mlp.experts.gate_up_proj": ("layers.{i}.mlp.w1", "layers.{i}.mlp.w3"),
    "model.layers.{i}.mlp.experts.down_proj": "layers.{i}.mlp.w2",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
GPT2_NAMES = {  # GPT-2's name -> the course's: a tuple (transposed?, names...), one after another along its last dim
    "transformer.wte.weight": "tok_embeddings.weight",
    "transformer.wpe.weight": "pos_embeddings.weight",
    "transformer.h.{i}.ln_1.weight": "layers.{i}.attn_norm.weight",
    "transformer.h.{i}.ln_1.bias": "layers.{i}.attn_norm.bias",
    "transformer.h.{i}.attn.c_attn.weight": (True, *(f"layers.{{i}}.attn.{w}.weight" for w in ("wq", "wk", "wv"))),
    "transformer.h.{i}.attn.c_attn.bias": (False, *(f"layers.{{i}}.attn.{w}.bias" for w in ("wq", "wk", "wv"))),
    "transformer.h.{i}.attn.c_proj.weight": (True, "layers.{i}.attn.wo.weight"),
    "transformer.h.{i}.attn.c_proj.bias": "layers.{i}.attn.wo.bias",
    "transformer.h.{i}.ln_2.weight": "layers.{i}.mlp_norm.weight",
    "transformer.h.{i}.ln_2.bias": "layers.{i}.mlp_norm.bias",
    "transformer.h.{i}.mlp.c_fc.weight": (True, "layers.{i}.mlp.w1.weight"),
    "transformer.h.{i}.mlp.c_fc.bias": "layers.{i}.mlp.w1.bias",
    "transformer.h.{i}.mlp.c_proj.weight": (True, "layers.{i}.mlp.w2.weight"),
    "transformer.h.{i}.mlp.c_proj.bias": "layers.{i}.mlp.w2.bias",
    "transformer.ln_f.weight": "norm.weight",
    "transformer.ln_f.bias": "norm.bias",
    "lm_head.weight": "output.weight",
}
GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")  # the hub checkpoint's causal masks: no parameters, skipped
GPT2_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}  # activation_function -> approximate
UNLIKE = {  # families the course's model cannot express, and why (config_from_hf says so)
    "qwen2": "its q, k and v projections have biases and its o projection none; the course's bias option is all four",
    "gemma": "its RMSNorm scales by 1 + weight, its embedding by sqrt(hidden_size), its MLP is GELU-gated",
}
DENSE = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
MOE = ("mlp.gate.", "mlp.experts.")


def config_from_hf(hf) -> ModelConfig:
    """A Hugging Face LlamaConfig, MixtralConfig or GPT2Config -> the course's ModelConfig; a ValueError naming
    everything the course's model does not compute."""
    kind = getattr(hf, "model_type", None)
    if kind == "gpt2":
        return _config_from_gpt2(hf)
    if kind not in ("llama", "mixtral"):
        why = f" ({UNLIKE[kind]})" if kind in UNLIKE else ""
        raise ValueError(f"the course's model converts Hugging Face's 'llama', 'mixtral' and 'gpt2', not {kind!r}{why}")
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    refuse = [f"{name}={getattr(hf, name)!r} (the course's {what})" for name, ok, what in [
        ("attention_bias", False, "Llama has no biases (its bias option is GPT-2's)"),
        ("mlp_bias", False, "Llama has no biases (its bias option is GPT-2's)"),
        ("hidden_act", "silu", "MLP is SwiGLU: silu"),
        ("head_dim", hf.hidden_size // hf.num_attention_heads, "head_dim is hidden_size / num_attention_heads"),
        ("sliding_window", None, "attention is fully causal, no sliding window"),
        ("attention_dropout", 0.0, "model has no dropout"),
        ("router_jitter_noise", 0.0, "router has no jitter noise"),
    ] if getattr(hf, name, None) is not None and getattr(hf, name) != ok]
    if rope.get("rope_type", rope.get("type", "default")) != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse.append(f"rope_parameters={rope} (the course's rotary embedding is the default one, over all of "
                      f"head_dim, with no scaling)")
    if refuse:
        raise ValueError("the course's model cannot express this Hugging Face config: " + "; ".join(refuse))
    # Mixtral's balancing loss counts each of the k slots apart: k x the course's f_i, so k x its coefficient
    moe = dict(n_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok, capacity_factor=None,
               aux_loss_coef=hf.router_aux_loss_coef * hf.num_experts_per_tok) if kind == "mixtral" else {}
    return ModelConfig(vocab_size=hf.vocab_size, dim=hf.hidden_size, n_layers=hf.num_hidden_layers,
                       n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
                       ffn_dim=hf.intermediate_size, max_seq_len=hf.max_position_embeddings,
                       rope_theta=float(theta), norm_eps=hf.rms_norm_eps, **moe)


def _config_from_gpt2(hf) -> ModelConfig:
    """GPT-2's config -> the course's: GPT-2's options (lab/model.py's GPT2), its vocabulary padded to a multiple of
    128. Its dropout is left out (the course trains without), as a fine-tune from GPT-2 usually is (nanoGPT)."""
    refuse = [f"{name}={getattr(hf, name)!r} (the course's {what})" for name, ok, what in [
        ("scale_attn_weights", True, "attention scales its scores by 1/sqrt(head_dim)"),
        ("scale_attn_by_inverse_layer_idx", False, "attention does not scale by 1/layer"),
        ("add_cross_attention", False, "model is a decoder alone, without cross-attention"),
    ] if getattr(hf, name, ok) != ok]
    if hf.activation_function not in GPT2_GELU:
        refuse.append(f"activation_function={hf.activation_function!r} (the course's MLP is GELU: "
                      f"{sorted(GPT2_GELU)})")
    if refuse:
        raise ValueError("the course's model cannot express this Hugging Face config: " + "; ".join(refuse))
    return ModelConfig(vocab_size=hf.vocab_size, dim=hf.n_embd, n_layers=hf.n_layer, n_heads=hf.n_head,
                       n_kv_heads=hf.n_head, ffn_dim=hf.n_inner or 4 * hf.n_embd, max_seq_len=hf.n_positions,
                       norm_eps=hf.layer_norm_epsilon, **dict(GPT2, tie_embeddings=hf.tie_word_embeddings,
                                                              gelu_approximate=GPT2_GELU[hf.activation_function]))


def family(cfg: ModelConfig) -> str:
    """The Hugging Face model a course config converts to: 'llama', 'mixtral' or 'gpt2'; else a ValueError naming
    what the nearer of Llama and GPT-2 does not have."""
    gpt2 = dict(norm="layer", norm_bias=True, mlp="gelu", positions="learned", bias=True, embed_norm=False,
                n_experts=0, n_kv_heads=cfg.n_heads)
    llama = dict(norm="rms", mlp="swiglu", positions="rope", bias=False, embed_norm=False)
    if cfg.norm == "layer":
        differ = [f"{k}={getattr(cfg, k)!r} (GPT-2's: {v!r})" for k, v in gpt2.items() if getattr(cfg, k) != v]
        if not differ:
            return "gpt2"
    else:
        differ = [f"{k}={getattr(cfg, k)!r} (Llama's: {v!r})" for k, v in llama.items() if getattr(cfg, k) != v]
        differ += [f"a padded vocabulary (vocab_multiple={cfg.vocab_multiple}: Llama's conversion keeps every row)"
                   ] if cfg.padded_vocab != cfg.vocab_size else []
        if not differ:
            return "mixtral" if cfg.n_experts else "llama"
    raise ValueError("a Hugging Face model holds the course's model only as Llama, Mixtral or GPT-2; this one is none "
                     "of them: " + "; ".join(differ))


def architecture(config) -> str:
    """The model class transformers' from_pretrained builds from a config this module makes."""
    return "GPT2LMHeadModel" if config.model_type == "gpt2" else type(config).__name__.replace("Config", "ForCausalLM")


def hf_config(cfg: ModelConfig, tied: bool = False):
    """The course's ModelConfig -> a Hugging Face LlamaConfig (MixtralConfig if it has experts), or a GPT2Config (the
    course's model with GPT-2's options, family(cfg)); tied (or cfg.tie_embeddings): the head is the embedding."""
    import transformers  # only here: the rest of this module needs no transformers

    tied = tied or cfg.tie_embeddings
    if family(cfg) == "gpt2":
        end = 50256 if cfg.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, if the vocabulary has it
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.dim, n_layer=cfg.n_layers,
            n_head=cfg.n_heads, n_inner=cfg.ffn_dim, layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=tied,
            activation_function="gelu_new" if cfg.gelu_approximate == "tanh" else "gelu", resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=end, eos_token_id=end)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
                  num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  intermediate_size=cfg.ffn_dim, max_position_embeddings=cfg.max_seq_len,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                  rms_norm_eps=cfg.norm_eps, tie_word_embeddings=tied)
    if cfg.n_experts:
        if cfg.capacity_factor is not None:
            raise ValueError("Mixtral is dropless: convert a course model with capacity_factor=None")
        return transformers.MixtralConfig(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                                          router_aux_loss_coef=cfg.aux_loss_coef / cfg.top_k,
                                          output_router_logits=True, **common)  # its loss adds the aux, as ours
    return transformers.LlamaConfig(**common)


def _names(cfg: ModelConfig):
    """(Hugging Face name, course name or names) of every tensor of this config, from the one table."""
    for hf, course in HF_NAMES.items():
        if (any(m in hf for m in MOE) and not cfg.n_experts) or (any(d in hf for d in DENSE) and cfg.n_experts):
            continue
        for i in range(cfg.n_layers) if "{i}" in hf else [None]:
            yield hf.format(i=i), (tuple(c.format(i=i) for c in course) if isinstance(course, tuple)
                                   else course.format(i=i))


def _stack_saved_experts(sd: dict, cfg: ModelConfig) -> dict:
    """Mixtral as saved on disk (block_sparse_moe.gate, block_sparse_moe.experts.{j}.w1/w3 [F, H], w2 [H, F])
    -> as held in memory (mlp.gate, mlp.experts.gate_up_proj [E, 2F, H], down_proj [E, H, F])."""
    if not any(".block_sparse_moe." in k for k in sd):
        return sd
    out = {k: v for k, v in sd.items() if ".block_sparse_moe." not in k}
    for i in range(cfg.n_layers):
        old, new = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
        w = {n: torch.stack([sd[f"{old}experts.{j}.{n}.weight"] for j in range(cfg.n_experts)])
             for n in ("w1", "w2", "w3")}
        out[new + "gate.weight"] = sd[old + "gate.weight"]
        out[new + "experts.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
        out[new + "experts.down_proj"] = w["w2"]
    return out


def to_course(sd: dict, cfg: ModelConfig) -> dict:
    """A Hugging Face state dict (as its model holds it, or Mixtral as saved) -> the course's state dict for cfg
    (the same tensors, not copies, but for a tied matrix's second use). A tied checkpoint (no lm_head.weight,
    or lm_head.weight in the embedding's memory) gives the embedding's matrix to the output head too — a copy for
    Llama; GPT-2's tied course model holds one matrix, under both names (as its state_dict() does)."""
    if family(cfg) == "gpt2":
        return _gpt2_to_course(sd, cfg)
    sd = _stack_saved_experts(dict(sd), cfg)
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing = [hf for hf, _ in _names(cfg) if hf not in sd]
    extra = sorted(set(sd) - {hf for hf, _ in _names(cfg)})
    if missing or extra:
        raise ValueError(f"this state dict does not fit {cfg}: missing {missing[:4]}, unexpected {extra[:4]}")
    out = {}
    for hf, course in _names(cfg):
        if isinstance(course, tuple):  # gate_up_proj [E, 2F, H]: the gate's F rows first, then the up's
            out.update(zip(course, (part.contiguous() for part in sd[hf].chunk(len(course), dim=1))))
        else:
            out[course] = sd[hf]
    if out["output.weight"].data_ptr() == out["tok_embeddings.weight"].data_ptr():
        out["output.weight"] = out["output.weight"].clone()  # a tied checkpoint's one matrix: two tensors here
    return out


def to_hf(sd: dict, cfg: ModelConfig, tied: bool = False) -> dict:
    """The course's state dict -> a Hugging Face one (as its model's state_dict() holds it; save_pretrained
    writes Mixtral's per-expert layout from it). tied=True: embedding and head are one tensor, under both
    names — only if the course model's two are still equal."""
    if family(cfg) == "gpt2":
        return _gpt2_to_hf(sd, cfg)
    if tied and not torch.equal(sd["tok_embeddings.weight"], sd["output.weight"]):
        raise ValueError("tied=True, but tok_embeddings and output differ: a tied model holds one matrix "
                         "(convert with tied=False)")
    out = {hf: torch.cat([sd[c] for c in course], dim=1) if isinstance(course, tuple) else sd[course]
           for hf, course in _names(cfg)}
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _course_shapes(cfg: ModelConfig) -> dict:
    return {n: tuple(p.shape) for n, p in build_model(cfg, device="meta").named_parameters()}


def _gpt2_to_course(sd: dict, cfg: ModelConfig) -> dict:
    """GPT-2's state dict (its model's, with or without "transformer.", or as saved) -> the course's, block by block
    of disk_map's parts (new tensors: GPT-2's are transposed or fused); a padded vocabulary's extra rows zeros."""
    parts, shapes = disk_map(cfg, set(sd))
    wrong = [f"{t}: {tuple(sd[t].shape) if t in sd else 'missing'}, not {shape}" for t, shape in shapes.items()
             if t not in sd or tuple(sd[t].shape) != tuple(shape)]
    extra = sorted(t for t in set(sd) - set(shapes) if not ignorable(t, cfg))
    if wrong or extra:
        raise ValueError(f"this state dict does not fit {cfg}: {wrong[:3]}, unexpected {extra[:4]}")
    out = {}
    for name, shape in _course_shapes(cfg).items():
        blocks = [read_rows(part, lambda t: sd[t], shape[-1] if len(shape) > 1 else 1) for part in parts[name]]
        dtype = next(b.dtype for (t, *_), b in zip(parts[name], blocks) if t is not None)
        out[name] = torch.cat([b.to(dtype) for b in blocks]).reshape(shape)
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _gpt2_to_hf(sd: dict, cfg: ModelConfig) -> dict:
    """The course's state dict -> GPT-2's, as GPT2LMHeadModel's state_dict() holds it (tied: lm_head.weight is the
    embedding's tensor); a padded vocabulary's extra rows left out."""
    parts, shapes = disk_map(cfg, {"lm_head.weight"})
    dtype = sd["tok_embeddings.weight"].dtype
    out = {t: torch.empty(shape, dtype=dtype) for t, shape in shapes.items()}
    for name, shape in _course_shapes(cfg).items():
        rows, first = sd[name].reshape(_rows(shape), -1), 0
        for part in parts[name]:
            write_rows(out, part, rows[first:first + part[3]])
            first += part[3]
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def read_rows(part, tensor, width: int) -> torch.Tensor:
    """The course tensor's rows that one block of disk_map's parts holds, [rows, width], from tensor(file name) (a
    padding block: zeros)."""
    name, index, first, n, transposed = part
    if name is None:
        return torch.zeros(n, width)
    t = tensor(name)[index] if index else tensor(name)
    if transposed:   # the course's rows are the file tensor's columns
        return t[:, first:first + n].T
    return t[first:first + n, None] if t.dim() == 1 else t.reshape(-1, t.shape[-1])[first:first + n]


def write_rows(files: dict, part, rows: torch.Tensor) -> None:
    """Put rows [n, width] of a course tensor into the file tensor that one block of disk_map's parts names (in
    `files`, {name: tensor}); a padding block goes nowhere."""
    name, index, first, n, transposed = part
    if name is None:
        return
    t = files[name][index] if index else files[name]
    if transposed:
        t[:, first:first + n] = rows.T
    elif t.dim() == 1:
        t[first:first + n] = rows[:, 0]
    else:
        t.view(-1, t.shape[-1])[first:first + n] = rows


def ignorable(name: str, cfg: ModelConfig) -> bool:
    """A tensor of a checkpoint that holds no parameter of the course's model: a rotary table, GPT-2's causal-mask
    buffers, a tied GPT-2's lm_head.weight (the embedding's matrix again)."""
    return name.endswith("rotary_emb.inv_freq") or name.endswith(GPT2_BUFFERS) or (
        name == "lm_head.weight" and cfg.tie_embeddings and family(cfg) == "gpt2")


# ---- a model directory on disk: its config, and where each of the course's tensors lies in its files --------

def read_config(directory: str) -> ModelConfig:
    """config.json of a Hugging Face model directory -> the course's ModelConfig (transformers reads the file, so
    its defaults fill what the file leaves out); one ValueError saying why not."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--init-from {directory!r} holds no config.json: give a Hugging Face model directory "
                         f"(config.json and safetensors weights, as save_pretrained writes it) or a state dict file")
    return _read_config(os.path.abspath(directory), os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=8)  # (the file's time in the key: a rewritten config.json is read again)
def _read_config(directory: str, _mtime: int) -> ModelConfig:
    import transformers  # only here: the rest of this module needs no transformers

    path = os.path.join(directory, "config.json")
    try:
        hf = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} cannot be read as a Hugging Face config ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]})") from None
    try:
        return config_from_hf(hf)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def disk_map(cfg: ModelConfig, present) -> tuple[dict, dict]:
    """Where the course's tensors lie among a checkpoint's tensors named `present` (tied: no lm_head.weight;
    Mixtral's experts per expert as save_pretrained writes them, or stacked as the model holds them; GPT-2's names
    with "transformer." or, as the hub's own checkpoint, without):

        parts   {course name: [(file tensor, index, first, rows, transposed), ...]}: the course tensor seen as rows
                (every dimension but the last merged; a vector: one element a row) is these blocks one after
                another, each `rows` rows of the file tensor (at `index` of its leading dimensions) from `first` —
                transposed: `rows` of its COLUMNS from `first` (GPT-2's Conv1D weights); file tensor None: rows that
                are in no file (a padded vocabulary's: zeros in, left out)
        shapes  {file tensor: the shape it must have}

    e.g. Mixtral's w1 [E, F, H] is experts.0.w1.weight [F, H], then experts.1.w1.weight, ...; or, stacked, rows
    0..F of gate_up_proj[0] [2F, H], then of gate_up_proj[1], ... (w3: rows F..2F of each); GPT-2's wk [H, H] is
    columns H..2H of c_attn.weight [H, 3H]."""
    course = _course_shapes(cfg)
    if family(cfg) == "gpt2":
        return _gpt2_disk_map(cfg, present, course)
    tied = "lm_head.weight" not in present or cfg.tie_embeddings
    stacked = any(".mlp.experts." in n for n in present)
    parts, shapes = {}, {}

    def whole(file_name, name):  # the same tensor under another name
        shapes[file_name], parts[name] = course[name], [(file_name, (), 0, _rows(course[name]), False)]

    for hf, names in _names(cfg):
        if hf == "lm_head.weight" and tied:  # one matrix on disk, two in the course's model
            continue
        saved = hf.replace(".mlp.", ".block_sparse_moe.")  # Mixtral as save_pretrained writes it
        if not any(m in hf for m in MOE):
            whole(hf, names)
        elif hf.endswith(".mlp.gate.weight"):  # the router
            whole(hf if stacked else saved, names)
        elif stacked:  # gate_up_proj [E, 2F, H]: w1's F rows then w3's, per expert; down_proj [E, H, F]: w2
            group = (names,) if isinstance(names, str) else names
            e, rows, width = course[group[0]]
            shapes[hf] = (e, rows * len(group), width)
            for k, name in enumerate(group):
                parts[name] = [(hf, (j,), k * rows, rows, False) for j in range(e)]
        else:  # per expert: experts.j.w1.weight [F, H], w3 [F, H], w2 [H, F]
            for name in (names,) if isinstance(names, str) else names:
                e, rows, width = course[name]
                per = [saved.split(".experts.")[0] + f".experts.{j}.{name.split('.')[-1]}.weight" for j in range(e)]
                shapes.update((n, (rows, width)) for n in per)
                parts[name] = [(n, (), 0, rows, False) for n in per]
    if tied and "output.weight" in course:
        parts["output.weight"] = parts["tok_embeddings.weight"]
    return parts, shapes


def _gpt2_disk_map(cfg: ModelConfig, present, course: dict) -> tuple[dict, dict]:
    """disk_map for GPT-2 (GPT2_NAMES): the hub's names lack "transformer." when its wte does."""
    prefix = "" if "wte.weight" in present and "transformer.wte.weight" not in present else "transformer."
    parts, shapes = {}, {}
    for hf, names in GPT2_NAMES.items():
        if hf == "lm_head.weight" and cfg.tie_embeddings:  # the embedding's matrix: on disk once
            continue
        transposed, *names = names if isinstance(names, tuple) else (False, names)
        file_name = hf.replace("transformer.", prefix) if hf.startswith("transformer.") else hf
        for i in range(cfg.n_layers) if "{i}" in hf else [None]:
            t, first = file_name.format(i=i), 0
            for name in (n.format(i=i) for n in names):
                rows = course[name][0]   # (a vector: one element a row)
                if name in ("tok_embeddings.weight", "output.weight"):  # the padded vocabulary's rows: on no disk
                    parts[name] = [(t, (), 0, cfg.vocab_size, False), (None, (), 0, rows - cfg.vocab_size, False)][
                        :1 + (rows > cfg.vocab_size)]
                    rows = cfg.vocab_size
                else:
                    parts[name] = [(t, (), first, rows, transposed)]
                first += rows
            width = course[names[0].format(i=i)]
            shapes[t] = ((width[-1], first) if transposed else (first, width[-1]) if len(width) > 1 else (first,))
    return parts, shapes


def _rows(shape) -> int:
    """A tensor seen as rows: every dimension but the last merged (a vector: one element a row)."""
    return math.prod(shape[:-1]) if len(shape) > 1 else shape[0]
