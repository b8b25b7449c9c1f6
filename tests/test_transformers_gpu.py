"""attn_implementation="cute_attention" (flash_cute) in Hugging Face transformers, on small
random-init models of each architecture (tests/hf_models.py): prefill logits against the same
weights in float32 eager attention, within twice the error of bf16 SDPA (plus a floor), a
left-padded batch, and a short greedy generate through transformers' caches."""

import pytest
import torch
from hf_models import MODELS, tiny_config

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

from flash_cute.integrations import transformers as fc_transformers  # noqa: E402

PROMPT = 100  # longer than the sliding windows (hf_models.WINDOW)


def build(model_type, attn, dtype, state=None):
    config = tiny_config(model_type)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    if state is not None:
        model.load_state_dict(state)
    return model.to(device="cuda", dtype=dtype).eval()


def build_low(model_type, state):
    """bf16 SDPA, the error bar (bf16 eager where the model has no SDPA path: the same math)."""
    try:
        return build(model_type, "sdpa", torch.bfloat16, state)
    except ValueError:  # no SDPA path (gpt-oss's sinks)
        return build(model_type, "eager", torch.bfloat16, state)


@pytest.fixture(scope="module", autouse=True)
def registered():
    fc_transformers.register()


def within_sdpa_error(models, ids, mask=None, real=None):
    """Max logit error of flash_cute against float32 eager, and bf16 SDPA's (the bar; bf16
    eager where the model has no SDPA path), over the positions `real` marks (default all)."""
    reference, ours, sdpa = models
    ref = reference(ids, attention_mask=mask).logits
    got = ours(ids, attention_mask=mask).logits.float()
    low = sdpa(ids, attention_mask=mask).logits.float()
    if real is not None:
        ref, got, low = ref[real], got[real], low[real]
    return (got - ref).abs().max().item(), (low - ref).abs().max().item()


@pytest.mark.parametrize("model_type", sorted(MODELS))
@torch.inference_mode()
def test_prefill_logits_and_generate(model_type):
    torch.manual_seed(0)
    reference = build(model_type, "eager", torch.float32)
    state = {k: v.cpu() for k, v in reference.state_dict().items()}
    ours = build(model_type, fc_transformers.NAME, torch.bfloat16, state)
    models = (reference, ours, build_low(model_type, state))
    ids = torch.randint(3, 512, (2, PROMPT), device="cuda")
    err, bar = within_sdpa_error(models, ids)
    assert err <= 2 * bar + 1e-2, f"{model_type}: prefill logit error {err:.3e}, SDPA {bar:.3e}"

    # A left-padded batch (row 1 padded by 17), at the real tokens.
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    err, bar = within_sdpa_error(models, ids, mask, mask.bool())
    assert err <= 2 * bar + 1e-2, f"{model_type}: left-padded error {err:.3e}, SDPA {bar:.3e}"

    # Greedy generate (prefill, then one-token steps over the cache), then the generated
    # sequence teacher-forced.
    new = 12
    out = ours.generate(ids[:, :40], max_new_tokens=new, do_sample=False, min_new_tokens=new)
    assert out.shape == (2, 40 + new)
    assert ((out >= 0) & (out < 512)).all()
    err, bar = within_sdpa_error(models, out)
    assert err <= 2 * bar + 1e-2, f"{model_type}: generated error {err:.3e}, SDPA {bar:.3e}"


# (Not Llama 4: its NoPE layers scale queries by the token's index in the batch row, not its
# position id, so packing changes its math before attention.)
@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2", "qwen3"])
@torch.inference_mode()
def test_packed_prefill_attends_within_each_sequence(model_type):
    """A batch of one packing three sequences (position_ids restarting, no mask): each
    sequence's logits are those of the sequence run alone (float32 eager), within twice bf16
    SDPA's error."""
    torch.manual_seed(1)
    reference = build(model_type, "eager", torch.float32)
    state = {k: v.cpu() for k, v in reference.state_dict().items()}
    ours = build(model_type, fc_transformers.NAME, torch.bfloat16, state)
    low = build_low(model_type, state)
    lengths = [70, 17, 113]
    ids = torch.randint(3, 512, (1, sum(lengths)), device="cuda")
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths]).unsqueeze(0)
    pieces = torch.split(ids, lengths, dim=1)
    alone = torch.cat([reference(p).logits for p in pieces], dim=1)
    alone_low = torch.cat([low(p).logits.float() for p in pieces], dim=1)
    got = ours(ids, position_ids=positions).logits.float()
    err, bar = (got - alone).abs().max().item(), (alone_low - alone).abs().max().item()
    assert err <= 2 * bar + 1e-2, f"{model_type}: packed error {err:.3e}, SDPA {bar:.3e}"


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3"])
@torch.inference_mode()
def test_static_cache_generate(model_type):
    """generate with cache_implementation="static" (its slots outnumber the tokens, no padding
    mask): each step's logits against float32 eager on the generated sequence."""
    torch.manual_seed(2)
    reference = build(model_type, "eager", torch.float32)
    state = {k: v.cpu() for k, v in reference.state_dict().items()}
    ours = build(model_type, fc_transformers.NAME, torch.bfloat16, state)
    low = build_low(model_type, state)
    prompt, new = 40, 12
    ids = torch.randint(3, 512, (1, prompt), device="cuda")
    result = ours.generate(
        ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
        return_dict_in_generate=True, cache_implementation="static",
    )  # fmt: skip
    sequence = result.sequences
    steps = torch.stack(result.logits, dim=1).float()  # (1, new, vocab)
    ref = reference(sequence).logits[:, prompt - 1 : prompt - 1 + new]
    lowp = low(sequence).logits[:, prompt - 1 : prompt - 1 + new].float()
    err, bar = (steps - ref).abs().max().item(), (lowp - ref).abs().max().item()
    assert err <= 2 * bar + 1e-2, f"{model_type}: static-cache error {err:.3e}, SDPA {bar:.3e}"
