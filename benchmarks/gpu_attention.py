"""A decode step's attention on a GPU, one layer (GPT-2 124M: 12 heads of 64), per batch and cache length:
the engine's SDPA path (the new keys written by index_put, then SDPA under a boolean mask over the span)
against kernels/decode_attention.py's Triton kernel (the write and each row's own keys in one kernel), and
flash SDPA with no mask over the whole span (not the right answer for rows of different lengths: a
bandwidth reference). Rows' lengths are drawn in [span/2, span]. Reports the kernel's relative error against
the SDPA path (the tests marked cuda are what holds it to a bound), then times each with CUDA events around
50 calls, median of 7. One device call's part (benchmarks/gpu_round.sh attention).

    PYTHONPATH=src python benchmarks/gpu_attention.py --out $OUT/attention-cuda.json
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt2ffn.bench import cuda_event_ms
from gpt2ffn.kernels.decode_attention import decode_attention


def timed(f, calls=50, repeats=7) -> float:
    """Median microseconds of one call."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    return statistics.median(cuda_event_ms(f, calls) * 1e3 for _ in range(repeats))


def one_shape(B, span, H, D, dtype, g) -> dict:
    dev = "cuda"
    kc = torch.randn(B, H, span, D, device=dev, dtype=dtype, generator=g)
    vc = torch.randn(B, H, span, D, device=dev, dtype=dtype, generator=g)
    qkv = torch.randn(B, 1, 3 * H * D, device=dev, dtype=dtype, generator=g)
    q, k, v = [t.view(B, 1, H, D).transpose(1, 2) for t in qkv.split(H * D, 2)]
    pos = torch.randint(span // 2, span, (B,), device=dev, generator=g)
    rows_idx = torch.arange(B, device=dev)

    def sdpa_masked():
        kc[rows_idx, :, pos] = k[:, :, 0]
        vc[rows_idx, :, pos] = v[:, :, 0]
        mask = (torch.arange(span, device=dev) <= pos[:, None])[:, None, None]
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
            y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
        return y.transpose(1, 2).reshape(B, 1, H * D)

    def flash_unmasked():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, kc, vc)

    def triton_fused():
        return decode_attention(q, k, v, kc, vc, pos)

    want = sdpa_masked().float()
    got = triton_fused().float()
    r = {"batch": B, "span": span, "rel_err_vs_sdpa": ((got - want).norm() / want.norm()).item(),
         "valid_kv_mb": 2 * int((pos + 1).sum()) * H * D * kc.element_size() / 1e6}
    for name, f in (("sdpa masked", sdpa_masked), ("flash unmasked", flash_unmasked), ("triton fused", triton_fused)):
        r[name] = timed(f)
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--span", type=int, nargs="+", default=[192, 1024])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--out")
    a = p.parse_args()
    H, D = 12, 64
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.dtype}, H={H} D={D}: us per layer")
    for span in a.span:
        for B in a.batch:
            r = one_shape(B, span, H, D, dtype, g)
            rows.append(r)
            print(f"  B={B:<4} span={span:<5} sdpa masked {r['sdpa masked']:8.1f}  flash unmasked "
                  f"{r['flash unmasked']:8.1f}  triton fused {r['triton fused']:8.1f}  "
                  f"({r['valid_kv_mb'] / r['triton fused'] * 1e3:6.0f} GB/s of valid K/V; "
                  f"rel err {r['rel_err_vs_sdpa']:.1e})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": a.dtype,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
