"""Small random-init Hugging Face models for the transformers integration tests: one config
per architecture, sized so every attention feature the architecture has is exercised (GQA,
sliding windows shorter than the test prompts, softcap, sinks)."""

WINDOW = 48  # shorter than the prompts the tests use
# Llama 4's attention chunk: shorter than the prefill prompts (100), longer than the generate
# tests' 40 + 12 tokens (past a chunk, transformers' chunk cache drops keys: refused).
CHUNK = 64

COMMON = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
)

# (model_type, config overrides): head dim 64 everywhere (hidden 256 / 4 heads) unless set.
MODELS = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=64),
    "mistral": dict(sliding_window=WINDOW),
    "phi3": dict(pad_token_id=0),
    "gpt2": dict(n_embd=256, n_layer=2, n_head=4, n_positions=2048),
    "gpt_neox": dict(rotary_pct=0.25),
    "cohere": {},
    "starcoder2": dict(sliding_window=WINDOW),
    "gemma2": dict(
        head_dim=64,
        sliding_window=WINDOW,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=64,
    ),
    "gemma3_text": dict(head_dim=64, sliding_window=WINDOW, sliding_window_pattern=2),
    # MLA prefill: q/k head dim 64 + 128 = 192, v head dim 128 (DeepSeek-V3's shapes, scaled).
    "deepseek_v3": dict(
        moe_intermediate_size=128,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=4,
        n_group=2,  # (its router views the experts as n_group groups)
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
    ),
    # Chunked layers (the even ones) and full layers; MoE on every other layer.
    "llama4_text": dict(
        head_dim=64,
        attention_chunk_size=CHUNK,
        num_local_experts=2,
        num_experts_per_tok=1,
        intermediate_size_mlp=512,
        interleave_moe_layer_step=2,
        no_rope_layer_interval=2,
    ),
    "gpt_oss": dict(
        head_dim=64,
        num_attention_heads=8,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def tiny_config(model_type: str):
    from transformers import AutoConfig

    overrides = dict(COMMON)
    if model_type == "gpt2":
        overrides = dict(vocab_size=COMMON["vocab_size"], bos_token_id=1, eos_token_id=2)
    overrides.update(MODELS[model_type])
    return AutoConfig.for_model(model_type, **overrides)
