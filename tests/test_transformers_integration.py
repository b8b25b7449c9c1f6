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


# ----------------------------------------------------------------------------------------
# Whole models on the CPU: flash_cute's entry points computed by the float32 reference
# ----------------------------------------------------------------------------------------


def _reference_kvcache(q, k, v, cache_seqlens=None, cache_leftpad=None, **options):
    """flash_attn_with_kvcache as the integration calls it, row by row in float32."""
    from flash_cute.reference import attention_ref

    options.pop("k_descale", None), options.pop("v_descale", None)
    end = k.shape[1] if cache_seqlens is None else cache_seqlens
    rows = []
    for b in range(q.shape[0]):
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        out, _ = attention_ref(
            q[b : b + 1], k[b : b + 1, start:end], v[b : b + 1, start:end], **options
        )
        rows.append(out)
    return torch.cat(rows).to(q.dtype)


def _reference_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k=None, **options):
    """flash_attn_varlen_func as the integration calls it, sequence by sequence."""
    options.pop("max_seqlen_k", None)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = [
        _reference_kvcache(q[None, a:b], k[None, c:d], v[None, c:d], **options)[0]
        for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])
    ]
    return torch.cat(outs)


@pytest.fixture
def reference_kernels(monkeypatch):
    calls = []

    def record(fn, name):
        def wrapped(*args, **kwargs):
            calls.append((name, kwargs))
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(
        fc_transformers.interface, "flash_attn_with_kvcache", record(_reference_kvcache, "kvcache")
    )
    monkeypatch.setattr(
        fc_transformers.interface, "flash_attn_varlen_func", record(_reference_varlen, "varlen")
    )
    fc_transformers.register()
    return calls


def _models(config):
    """(float32 eager, bf16 cute_attention, bf16 eager) of one random init."""
    import copy

    from transformers import AutoModelForCausalLM

    def build(attn):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn)

    torch.manual_seed(0)
    reference = build("eager").eval()
    ours, low = build(fc_transformers.NAME), build("eager")
    ours.load_state_dict(reference.state_dict())
    low.load_state_dict(reference.state_dict())
    return reference, ours.to(torch.bfloat16).eval(), low.to(torch.bfloat16).eval()


def _errors(models, **inputs):
    """Max logit error of cute_attention and of bf16 eager against float32 eager."""
    reference, ours, low = models
    with torch.no_grad():
        ref = reference(**inputs).logits
        got = ours(**inputs).logits.float()
        lowp = low(**inputs).logits.float()
    return (got - ref).abs().max().item(), (lowp - ref).abs().max().item()


def test_llama4_chunked_layers_attend_within_their_chunks(reference_kernels):
    """Llama 4's chunked layers (attention_chunk_size 64, shorter than the prompt) get
    attention_chunk; its full layers do not."""
    config = hf_models.tiny_config("llama4_text")
    models = _models(config)
    ids = torch.randint(3, 512, (2, 100))
    err, bar = _errors(models, input_ids=ids)
    assert err <= 2 * bar + 1e-2, (err, bar)
    chunks = {kwargs.get("attention_chunk", 0) for _, kwargs in reference_kernels}
    assert chunks == {0, hf_models.CHUNK}


def test_llama4_generation_past_a_chunk_is_refused_by_name(reference_kernels):
    config = hf_models.tiny_config("llama4_text")
    _, ours, _ = _models(config)
    ids = torch.randint(3, 512, (1, hf_models.CHUNK - 2))
    with pytest.raises(NotImplementedError, match="chunked attention"):
        ours.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2", "qwen3"])
def test_packed_sequences_attend_within_each_sequence(reference_kernels, model_type):
    """A batch of one holding three sequences (position_ids restarting, no mask), as
    transformers' padding-free collators pack them (and its FlashAttention path reads them):
    each sequence's logits are those of the sequence run alone."""
    config = hf_models.tiny_config(model_type)
    reference, ours, low = _models(config)
    lengths = [30, 45, 25]
    ids = torch.randint(3, 512, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    pieces = torch.split(ids, lengths, dim=1)
    with torch.no_grad():
        alone = torch.cat([reference(input_ids=p).logits for p in pieces], dim=1)
        alone_low = torch.cat([low(input_ids=p).logits.float() for p in pieces], dim=1)
        got = ours(input_ids=ids, position_ids=positions).logits.float()
    err, bar = (got - alone).abs().max().item(), (alone_low - alone).abs().max().item()
    assert err <= 2 * bar + 1e-2, (err, bar)
    assert {name for name, _ in reference_kernels} == {"varlen"}


def test_static_cache_attends_to_the_filled_slots_only(reference_kernels):
    """generate with a static cache (its slots outnumber the tokens): the same greedy tokens and
    last-step logits as eager attention."""
    config = hf_models.tiny_config("llama")
    reference, ours, low = _models(config)
    ids = torch.randint(3, 512, (2, 20))
    kwargs = dict(max_new_tokens=5, do_sample=False, min_new_tokens=5, output_logits=True,
                  return_dict_in_generate=True, cache_implementation="static")  # fmt: skip
    with torch.no_grad():
        got = ours.generate(ids, **kwargs)
        want = low.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert (a.float() - b.float()).abs().max() < 0.1
    assert any(kwargs.get("cache_seqlens") for _, kwargs in reference_kernels)
