"""flash_cute in a few lines: attention on a Hopper GPU, checked against PyTorch.

    python examples/basic.py

Without a Hopper GPU it compiles the kernel for sm_90a (no launch) and says so.
"""

import time

import torch

import flash_cute
from flash_cute.reference import attention_ref, error_bound


def main():
    batch, seqlen, nheads, nheads_kv, head_dim = 2, 1000, 16, 4, 128  # GQA: 4 q heads per kv head
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        from flash_cute.compile_cache import compile_forward
        from flash_cute.precompile import func_variant

        start = time.time()
        config = flash_cute.default_config(head_dim, "bfloat16", True, seqlen)
        compile_forward(func_variant(config, head_dim, "bfloat16", True, writes_lse=True))
        print(
            f"no Hopper GPU here: compiled the sm_90a kernel in {time.time() - start:.1f}s, "
            "nothing to run"
        )
        return

    torch.manual_seed(0)
    q = torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, nheads_kv, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen, nheads_kv, head_dim, device="cuda", dtype=torch.bfloat16)

    out, lse = flash_cute.flash_attn_func(q, k, v, causal=True, return_lse=True)

    ref, lse_ref = attention_ref(q, k, v, causal=True)  # float32 math
    lowp, _ = attention_ref(q, k, v, causal=True, upcast=False)  # the same math in bf16
    err = (out.float() - ref).abs().max().item()
    bound = error_bound(lowp, ref)
    lse_err = (lse - lse_ref).abs().max().item()
    print(
        f"out {tuple(out.shape)} {out.dtype}: max error {err:.2e} (bound {bound:.2e}); "
        f"lse max error {lse_err:.2e}"
    )
    assert err <= bound and lse_err < 1e-3, "flash_cute disagrees with the reference"
    print("ok")


if __name__ == "__main__":
    main()
