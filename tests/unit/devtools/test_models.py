"""The offline model directories load in transformers and behave like the models they stand for."""

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from h2o_devtools import models
from h2o_devtools.models import real

GPL3_START = "This program is free software: you can redistribute it and/or modify"


def test_build_tiny_llama_is_fast_and_deterministic(tmp_path):
    models.build_tiny_llama(tmp_path / "warm")  # first call pays the lazy imports, not the build
    start = time.perf_counter()
    first = models.build_tiny_llama(tmp_path / "a", seed=3)
    assert time.perf_counter() - start < 5
    second = models.build_tiny_llama(tmp_path / "b", seed=3)
    for path in sorted(first.iterdir()):
        assert path.read_bytes() == (second / path.name).read_bytes(), path.name


def test_tiny_llama_loads_in_transformers(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    config = model.config
    assert model.dtype == torch.float32
    assert len(tokenizer) == config.vocab_size == 512
    assert config.num_key_value_heads < config.num_attention_heads  # GQA, as in SmolLM2
    assert config.head_dim == 32  # one vLLM's CPU attention supports


def test_tiny_llama_tokenizer_round_trips_text(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = "Hello, world!  Two spaces, digits 12345 and ünïcode."
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id not in ids  # no BOS/EOS added around the text


def test_tiny_llama_generates_finite_logits_with_peaky_attention(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager")
    prompt = tokenizer(GPL3_START * 4, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=200, do_sample=False, min_new_tokens=200,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=tokenizer.pad_token_id)
        assert all(torch.isfinite(step).all() for step in out.logits)
        attentions = model(out.sequences, output_attentions=True).attentions
    # H2O's keep/evict choices must not hinge on float noise: past the first tokens, each query's
    # top key gets a large share of its attention (uniform would give < 1/64).
    for layer in attentions:
        top_share = layer[0, :, 64:].max(dim=-1).values.mean()
        assert top_share > 0.3


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return tokenizer, model


def test_smollm2_answers_paris(smollm2):
    tokenizer, model = smollm2
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt.input_ids.shape[1]:])


def test_smollm2_tokenizer_splits_digits_and_adds_no_bos(smollm2):
    tokenizer, _ = smollm2
    assert tokenizer.tokenize("in 2024") == ["in", "Ġ", "2", "0", "2", "4"]
    ids = tokenizer("The capital").input_ids
    assert tokenizer.bos_token_id not in ids and len(ids) == 2
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.model_input_names == ["input_ids", "attention_mask"]


def test_smollm2_chat_template_comes_from_the_gguf(smollm2):
    tokenizer, _ = smollm2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer("<|im_start|>").input_ids == [tokenizer.bos_token_id]  # one special token


def test_gemma3_adds_one_bos(gemma3_dir):
    """Without <bos> Gemma's output is garbage; the GGUF asks for it but transformers' loaded
    tokenizer drops it, so the build puts it back (once). (That the model then continues text
    sensibly shows in its quality table; that vLLM serves it as the oracle runs it, in
    tests/engine/test_real_model.py.)"""
    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    ids = tokenizer("The capital of France is").input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_gemma3_is_the_hybrid_it_stands_for(gemma3_dir):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(gemma3_dir)
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (config.sliding_window, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.vocab_size) == (512, 4, 1, 256, 262144)


def test_model_dir_takes_a_real_models_name_or_a_path(tmp_path):
    assert models.model_dir("gemma3-270m") == models.gemma3_dir()
    assert models.model_dir(None) == models.smollm2_dir()
    assert models.model_dir(tmp_path) == tmp_path


def test_a_gemma3_gguf_whose_defaults_moved_is_refused():
    from types import SimpleNamespace
    config = SimpleNamespace(query_pre_attn_scalar=256, sliding_window=512, num_hidden_layers=18,
                             rope_parameters={"sliding_attention": {"rope_theta": 10000.0}},
                             layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3)
    real._check_gemma3_config(config)
    config.query_pre_attn_scalar = 64
    with pytest.raises(ValueError, match="query_pre_attn_scalar"):
        real._check_gemma3_config(config)


def test_mirrored_llama_feeds_its_layer_the_embeddings_unchanged(tmp_path):
    """What an EAGLE-1 head needs to mirror the target (h2o_devtools.models.drafters): every
    embedding row finite with RMS 1 (the pad row too), every norm weight 1."""
    from h2o_devtools.models import drafters
    model = AutoModelForCausalLM.from_pretrained(drafters.build_mirrored_llama(tmp_path / "t")).eval()
    embed = model.model.embed_tokens.weight
    assert model.config.num_hidden_layers == 1 and torch.isfinite(embed).all()
    torch.testing.assert_close(embed.pow(2).mean(-1), torch.ones(embed.shape[0]))
    norm = model.model.layers[0].input_layernorm
    torch.testing.assert_close(norm(embed[:5]), embed[:5])


def test_an_eagle_head_is_the_targets_layer(tmp_path):
    from safetensors.torch import load_file

    from h2o_devtools.models import drafters
    target = drafters.build_mirrored_llama(tmp_path / "t")
    head = load_file(drafters.build_eagle_head(target, tmp_path / "h") / "model.safetensors")
    weights = load_file(target / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    torch.testing.assert_close(head["fc.weight"][:, :hidden], torch.eye(hidden))
    assert not head["fc.weight"][:, hidden:].any() and "layers.0.input_layernorm.weight" not in head
    torch.testing.assert_close(head["layers.0.self_attn.q_proj.weight"],
                               weights["model.layers.0.self_attn.q_proj.weight"])


def test_the_eagle3_pairs_target_greedy_token_ignores_the_residual_the_head_cannot_mirror(tmp_path):
    """``build_mirrored_eagle3_pair``: embeddings in the first half of the hidden dims, the
    layer's attention writing and the output head reading the second half only, no MLP; the
    head's q/k/v read the embedding half of its input, fc is 0, its aux layer is layer 1."""
    import json

    from safetensors.torch import load_file

    from h2o_devtools.models import drafters
    target, head = drafters.build_mirrored_eagle3_pair(tmp_path / "t", tmp_path / "h")
    weights, drafted = load_file(target / "model.safetensors"), load_file(head / "model.safetensors")
    half = weights["model.embed_tokens.weight"].shape[1] // 2
    assert not weights["model.embed_tokens.weight"][:, half:].any()
    assert not weights["model.layers.0.self_attn.o_proj.weight"][:half].any()
    assert not weights["lm_head.weight"][:, :half].any() and not weights["model.layers.0.mlp.down_proj.weight"].any()
    assert not drafted["fc.weight"].any()
    q = drafted["midlayer.self_attn.q_proj.weight"]
    torch.testing.assert_close(q[:, :2 * half], weights["model.layers.0.self_attn.q_proj.weight"])
    assert not q[:, 2 * half:].any()
    config = json.loads((head / "config.json").read_text())
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1]}


def test_the_mtp_target_is_a_qwen2_whose_mtp_layer_is_its_layer(tmp_path):
    """What vLLM's MiMo MTP layer needs to mirror the target (h2o_devtools.models.drafters):
    the target's layer copied, ``input_proj`` passing the token embedding; transformers loads
    the target as the Qwen2 it is (the oracle's model)."""
    import json

    from safetensors.torch import load_file

    from h2o_devtools.models import drafters
    target = drafters.build_mtp_target(tmp_path / "t")
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["MiMoForCausalLM"] and config["num_nextn_predict_layers"] == 1
    weights = load_file(target / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    proj = weights["model.mtp_layers.0.input_proj.weight"]
    assert not proj[:, :hidden].any()
    torch.testing.assert_close(proj[:, hidden:], torch.eye(hidden))
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.bias", "mlp.down_proj.weight"):
        torch.testing.assert_close(weights[f"model.mtp_layers.0.{name}"], weights[f"model.layers.0.{name}"])
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_hidden_layers == 1
