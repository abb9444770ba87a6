"""Real models in and out of train.py: a Hugging Face directory (config.json + safetensors, one file or shards)
starts any layout with exactly its weights, each rank reading about its own share of the bytes; --export-format
hf writes a directory transformers' from_pretrained loads, with the course's logits; a directory train.py
cannot use is refused on every rank before any collective; a tokenizer.json beside the weights tokenizes --data.

Every checkpoint here is written by transformers' save_pretrained from a tiny config with random float64
weights: nothing is downloaded. Expected values come from transformers' own state dict through lab/hf.py's
to_course (not through the reader under test)."""
import json
import os
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from harness import run_ranks
from lab import checkpoint
from lab.data import get_batch, load_corpus
from lab.hf import config_from_hf, to_course, to_hf
from lab.model import build_model, get_config, num_params
from lab.train_demo import reference_losses
from test_hf import float64_islands  # noqa: F401  (the fixture: transformers' float32 islands in float64)
from train import parse_args

EXACT = 1e-10
TOL64 = 1e-9
COMMON = ["--dtype", "float64", "--global-batch-size", "4", "--seq-len", "16", "--steps", "2", "--warmup", "1",
          "--quiet"]


def llama_config(vocab=256, tied=False):
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                    rope_parameters={"rope_type": "default", "rope_theta": 5e4}, rms_norm_eps=1e-6,
                                    tie_word_embeddings=tied)


def mixtral_config():
    return transformers.MixtralConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                      num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
                                      rope_parameters={"rope_type": "default", "rope_theta": 5e4},
                                      experts_implementation="eager")  # (its grouped_mm takes no float64 on CPU)


CAUSAL_LM = {"llama": transformers.LlamaForCausalLM, "mixtral": transformers.MixtralForCausalLM}


def saved(path, config, seed=0, **save_kw):
    """A float64 Hugging Face model with random weights (norms not 1), written by save_pretrained to `path`;
    returns the course's state dict of the same weights (lab.hf.to_course of the model's own state dict)."""
    torch.manual_seed(seed)
    model = CAUSAL_LM[config.model_type](config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    model = model.to(torch.float64)
    model.save_pretrained(path, **save_kw)
    return {k: v.clone() for k, v in to_course(model.state_dict(), config_from_hf(config)).items()}


def from_pretrained(path, kind):
    return CAUSAL_LM[kind].from_pretrained(path, dtype=torch.float64, **(
        {"experts_implementation": "eager"} if kind == "mixtral" else {}))


# ---- in: every layout starts from exactly the directory's weights --------------------------------------

class _Look:
    """train.train's observer: right after --init-from, each parameter this rank holds (gathered over its
    ZeRO group: the tp slice or experts it keeps whole) and the places of its pieces."""

    def begin(self, trainer, start):
        import fsdp
        self.held = fsdp.full_state_dict(trainer.opt)
        self.where = {n: trainer.where(n) for n in self.held}
        self.share = [p[4] - p[3] for _, _, p in fsdp.places(trainer.opt, trainer.where)]

    def around(self, trainer, step):
        return nullcontext()

    def after(self, trainer, step, loss):
        pass


def _start_from(cases, shard_bytes=None):
    """Rank function: train.train on each (flags, expected course state dict); per case this rank's largest
    difference from the expected values of every parameter it holds, the bytes it read from the files and
    the elements of its share, and the losses."""
    import train
    from lab.instruments import watch_calls
    if shard_bytes:
        checkpoint.SHARD_BYTES = shard_bytes
    out = []
    for flags, expected in cases:
        look = _Look()
        with watch_calls(train.Trainer, "init_from", memory=False) as inits:
            res = train.train(parse_args(flags), observer=look)
        diff = 0.0
        for name, held in look.held.items():
            shape, narrow = look.where[name]
            want = expected[name] if narrow is None else expected[name].narrow(narrow[0], narrow[1],
                                                                               narrow[2] - narrow[1])
            assert tuple(expected[name].shape) == tuple(shape) and held.shape == want.shape, name
            diff = max(diff, (held - want).abs().max().item())
        out.append(dict(flags=flags, diff=diff, names=sorted(look.held), read=inits[0]["result"] if inits else None,
                        share=sum(look.share), losses=res["losses"]))
    return out


# (flags, family) on 4 ranks: tp (4 > 2 kv heads: replicated), pp x ZeRO-3, ZeRO-3, cp x tp, tp x pp, tp x ZeRO-3
# read by rank 0, ep x ZeRO-3 and ep x tp; a tied checkpoint, a sharded one (13 files) and a stacked Mixtral
LAYOUTS = [(["--tp", "4"], "llama"),
           (["--pp", "2", "--dp-shard", "2"], "llama-sharded"),
           (["--dp-shard", "4"], "llama-tied"),
           (["--cp", "2", "--tp", "2"], "llama"),
           (["--pp", "2", "--tp", "2", "--sequence-parallel"], "llama-sharded"),
           (["--tp", "2", "--dp-shard", "2", "--init-read", "rank-0"], "llama"),
           (["--dp-shard", "4", "--ep", "4"], "mixtral"),
           (["--dp-shard", "2", "--tp", "2", "--ep", "2"], "mixtral-stacked")]
# tp x pp x dp needs 8 ranks
LAYOUTS_8 = [(["--pp", "2", "--tp", "2", "--dp-shard", "2"], "llama-sharded"),
             (["--pp", "2", "--dp-shard", "4", "--ep", "2", "--global-batch-size", "8"], "mixtral")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (directory, expected course state dict)}."""
    root, out = tmp_path_factory.mktemp("hf"), {}
    for family, config, kw in (("llama", llama_config(), {}), ("llama-tied", llama_config(tied=True), {}),
                               ("llama-sharded", llama_config(), dict(max_shard_size="20KB")),
                               ("mixtral", mixtral_config(), {})):
        out[family] = (str(root / family), saved(root / family, config, **kw))
    # Mixtral stacked as the model holds it (gate_up_proj [E, 2F, H]), as another tool may save it
    stacked, config = root / "mixtral-stacked", mixtral_config()
    torch.manual_seed(1)
    model = transformers.MixtralForCausalLM(config).to(torch.float64)
    os.makedirs(stacked)
    config.save_pretrained(stacked)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(stacked / "model.safetensors"))
    out["mixtral-stacked"] = (str(stacked), to_course(model.state_dict(), config_from_hf(config)))
    return out


def test_the_reader_gives_transformers_weights_in_one_process(models):
    """checkpoint.whole_model (every course tensor read whole through the lazy reader) is to_course of the
    model's own state dict, on every kind of directory: tied, sharded, Mixtral per expert and stacked."""
    for family, (path, expected) in models.items():
        got = checkpoint.whole_model(path)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), family
        assert checkpoint.hf_problems(path) == [], family
    assert len([f for f in os.listdir(models["llama-sharded"][0]) if f.endswith(".safetensors")]) > 3


def _case(models, flags, family):
    path, expected = models[family]
    return COMMON + flags + ["--init-from", path], expected


def _check_layouts(results, models, layouts, world):
    """Every rank holds exactly the directory's values; the losses are one process's from the same directory;
    each rank read about its share (every-rank), or rank 0 all the shares (rank-0)."""
    bytes_lines = []
    for i, (flags, family) in enumerate(layouts):
        per_rank = [r[i] for r in results]
        assert all(r["diff"] == 0.0 for r in per_rank), (flags, [r["diff"] for r in per_rank])
        held = set().union(*(r["names"] for r in per_rank))
        assert held == set(models[family][1]), (flags, sorted(set(models[family][1]) - held))
        want = reference_losses(parse_args(_case(models, flags, family)[0]))
        err = max(abs(a - b) for a, b in zip(per_rank[0]["losses"], want))
        assert err < TOL64, (flags, err)
        assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)
        read, share = [r["read"] for r in per_rank], [8 * r["share"] for r in per_rank]  # float64 files
        if "rank-0" in flags:
            assert sum(share) <= read[0] <= 1.2 * sum(share) and not any(read[1:]), (flags, read, share)
        else:  # each rank its own share, plus the rest of a first and last row of each piece
            assert all(s <= r <= 1.2 * s for r, s in zip(read, share)), (flags, read, share)
        bytes_lines.append(f"{' '.join(flags)} ({family}): bytes read per rank {read}, its share {share}")
    print("\n".join(bytes_lines))


def test_a_hf_directory_starts_every_layout_with_its_weights(models):
    layouts = [_case(models, f, fam) for f, fam in LAYOUTS]
    _check_layouts(run_ranks(_start_from, 4, layouts, timeout=600), models, LAYOUTS, 4)


def test_a_hf_directory_starts_tp_x_pp_x_dp_on_8_ranks(models):
    layouts = [_case(models, f, fam) for f, fam in LAYOUTS_8]
    _check_layouts(run_ranks(_start_from, 8, layouts, timeout=600), models, LAYOUTS_8, 8)
