"""flash_cute.integrations.transformers on the CPU: registration, and the calls it refuses by
name before any kernel runs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_models  # noqa: E402

from flash_cute.integrations import transformers as fc_transformers  # noqa: E402


class Layer(torch.nn.Module):
    is_causal = True


def qkv(d=64, dtype=torch.bfloat16, grad=False):
    q = torch.randn(2, 4, 10, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(2, 2, 10, d, dtype=dtype)
    v = torch.randn(2, 2, 10, d, dtype=dtype)
    return q, k, v


def test_register():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert fc_transformers.register() == "cute_attention"
    assert AttentionInterface._global_mapping["cute_attention"] is (
        fc_transformers.flash_cute_attention_forward
    )
    assert "cute_attention" in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (qkv(dtype=torch.float32), {}, "float32 activations"),
        (qkv(grad=True), {}, "gradients"),
        (qkv(), dict(output_attentions=True), "output_attentions"),
        (
            qkv(),
            dict(attention_mask=torch.tensor([[1] * 9 + [0], [1] * 10], dtype=torch.bool)),
            "other than left padding",
        ),
        (qkv(), dict(attention_mask=torch.ones(2, 1, 10, 10, dtype=torch.bool)), "2-D padding"),
    ],
)
def test_refused_calls_name_the_feature(args, kwargs, message):
    mask = kwargs.pop("attention_mask", None)
    with pytest.raises(NotImplementedError, match=message):
        fc_transformers.flash_cute_attention_forward(Layer(), *args, mask, **kwargs)


def test_dropout_in_training_is_refused():
    layer = Layer().train()
    with pytest.raises(NotImplementedError, match="dropout"):
        fc_transformers.flash_cute_attention_forward(layer, *qkv(), None, dropout=0.1)


def test_left_padding():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    assert fc_transformers._left_padding(mask, 4).tolist() == [2, 0, 3]
    # Every layer gets the same mask: checked once (the result is reused) until it changes.
    first = fc_transformers._left_padding(mask, 4)
    assert fc_transformers._left_padding(mask, 4) is first
    mask[1, 0] = False  # (in place: a new version)
    assert fc_transformers._left_padding(mask, 4).tolist() == [2, 1, 3]
    mask[1, 2] = False
    with pytest.raises(NotImplementedError, match="other than left padding"):
        fc_transformers._left_padding(mask, 4)


def test_left_padding_of_inference_masks():
    """A mask made under inference_mode has no version counter: checked every time (an
    in-place change is seen)."""
    with torch.inference_mode():
        mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
        assert fc_transformers._left_padding(mask, 3).tolist() == [1, 0]
        mask[1, 0] = False
        assert fc_transformers._left_padding(mask, 3).tolist() == [1, 1]


@pytest.mark.parametrize("model_type", sorted(hf_models.MODELS))
def test_tiny_models_run_eagerly(model_type):
    """The GPU test's tiny configs build and run with transformers' own attention (a config
    the model itself cannot run would fail the GPU test before flash_cute is reached)."""
    from transformers import AutoModelForCausalLM

    config = hf_models.tiny_config(model_type)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    logits = model(torch.randint(0, 100, (2, 17))).logits
    assert logits.shape[:2] == (2, 17) and torch.isfinite(logits).all()


def test_fp8_cache_and_descales_reach_the_kernel_call(monkeypatch):
    """float8_e4m3fn key/value (an FP8 cache) go to flash_attn_with_kvcache as they are, with
    the k_descale / v_descale keyword arguments."""
    seen = {}

    def native(q, k, v, **kwargs):
        seen.update(k=k, v=v, **kwargs)
        return q

    monkeypatch.setattr(fc_transformers.interface, "flash_attn_with_kvcache", native)
    q, k, v = qkv()
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    scale = torch.ones(2, 2)
    fc_transformers.flash_cute_attention_forward(
        Layer(), q, k8, v8, None, k_descale=scale, v_descale=scale
    )
    assert seen["k"].dtype == torch.float8_e4m3fn and seen["v"].dtype == torch.float8_e4m3fn
    assert seen["k_descale"] is scale and seen["v_descale"] is scale
