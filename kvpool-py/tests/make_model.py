"""Writes a tiny Llama (or, ``make_mla_model``, a DeepSeek-V2-shaped MLA model) with random
weights (seeded) for end-to-end tests with vLLM.

Random (not dummy) weights make the output depend on the KV cache: loading wrong KV changes
tokens and logprobs. Usage: python make_model.py OUT_DIR [--hidden 128 --layers 2 ...]
"""

import argparse
import json
import os

import torch
from safetensors.torch import save_file


def make_model(out_dir, hidden=128, layers=2, heads=4, kv_heads=2, vocab=1000,
               intermediate=256, max_positions=16384, seed=0):
    os.makedirs(out_dir, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rnd(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w = {
        "model.embed_tokens.weight": rnd(vocab, hidden, scale=1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rnd(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        w[p + "mlp.gate_proj.weight"] = rnd(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = rnd(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = rnd(hidden, intermediate)
    save_file(w, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def make_mla_model(out_dir, hidden=256, layers=2, heads=4, vocab=1000, intermediate=512,
                   kv_lora_rank=512, rope=64, nope=64, v_dim=64, seed=0):
    """A tiny DeepSeek-V2-shaped model (multi-head latent attention, MLA) with random weights:
    every layer dense (``first_k_dense_replace`` = ``layers``), DeepSeek's latent dimensions
    (512 + 64 rope) so vLLM's CPU MLA kernels take it."""
    os.makedirs(out_dir, exist_ok=True)
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "moe_intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "vocab_size": vocab,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": None,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v_dim,
        # No expert layer: the MoE fields are read but unused.
        "first_k_dense_replace": layers,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "attention_bias": False,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w = {
        "model.embed_tokens.weight": rnd(vocab, hidden, scale=1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rnd(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = rnd(heads * (nope + rope), hidden)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = rnd(kv_lora_rank + rope, hidden)
        w[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(kv_lora_rank)
        w[p + "self_attn.kv_b_proj.weight"] = rnd(heads * (nope + v_dim), kv_lora_rank)
        w[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * v_dim)
        w[p + "mlp.gate_proj.weight"] = rnd(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = rnd(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = rnd(hidden, intermediate)
    save_file(w, os.path.join(out_dir, "model.safetensors"))
    return out_dir


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=256)
    a = ap.parse_args()
    make_model(a.out_dir, a.hidden, a.layers, a.heads, a.kv_heads, intermediate=a.intermediate)
    print(a.out_dir)
