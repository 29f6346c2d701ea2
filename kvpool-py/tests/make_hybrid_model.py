"""Tiny hybrid models with random weights, made with transformers' own classes, for vLLM's
hybrid KV cache manager (several KV cache groups): a Gemma 3 shape (sliding-window and
full-attention layers, fp32) and a Qwen3-Next shape (Gated DeltaNet linear attention and full
attention, bf16: vLLM's CPU GDN kernel needs it).

Weights are rescaled to ``randn / sqrt(fan_in)`` (transformers' 0.02 init makes a prompt's
greedy tokens all the same token: outputs that do not depend on the KV test nothing).
"""

import os

import torch


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[-1]
                scale = 1.0 if "embed" in name else fan_in ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _save(model, config, out_dir, dtype):
    os.makedirs(out_dir, exist_ok=True)
    model = model.to(dtype)
    config.dtype = dtype
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_gemma3_model(out_dir, seed=0, sliding_window=64):
    """Gemma 3 text shape: 3 sliding-window layers (window ``sliding_window``) and 1 global."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=16384, sliding_window=sliding_window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    _randomize(model, seed)
    return _save(model, config, out_dir, torch.float32)


def make_qwen3_next_model(out_dir, seed=0):
    """Qwen3-Next shape: 3 Gated DeltaNet (linear attention) layers and 1 full attention
    layer, a small mixture of experts; linear key/value heads of 64 (the CPU kernel refuses 32)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, decoder_sparse_step=1,
        max_position_embeddings=16384, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config)
    _randomize(model, seed)
    return _save(model, config, out_dir, torch.bfloat16)


if __name__ == "__main__":
    import sys

    kind, out = sys.argv[1], sys.argv[2]
    print({"gemma3": make_gemma3_model, "qwen3-next": make_qwen3_next_model}[kind](out))
