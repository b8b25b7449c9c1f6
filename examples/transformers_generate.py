"""Hugging Face transformers with flash_cute's kernels: register once, then ask for
attn_implementation="cute_attention". Here a small random-init gpt-oss-style model (sliding
windows and attention sinks) generates greedily; with a checkpoint, use from_pretrained."""

import torch
import transformers

import flash_cute.integrations.transformers as fc_transformers

fc_transformers.register()  # 1: make "cute_attention" known to transformers

config = transformers.AutoConfig.for_model(
    "gpt_oss", vocab_size=1000, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=4,
    num_experts_per_tok=2, sliding_window=64, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
if not torch.cuda.is_available():
    raise SystemExit("flash_cute's kernels need a Hopper GPU; nothing to run here")
model = transformers.AutoModelForCausalLM.from_config(
    config,
    attn_implementation="cute_attention",  # 2: ask for it
).to(device="cuda", dtype=torch.bfloat16)
prompt = torch.randint(3, 1000, (1, 200), device="cuda")
with torch.inference_mode():
    tokens = model.generate(prompt, max_new_tokens=20, do_sample=False)
print("generated:", tokens[0, 200:].tolist())
