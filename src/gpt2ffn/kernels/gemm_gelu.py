"""c_fc as one Triton kernel on CUDA: x @ w + b with GPT-2's tanh GELU applied as the tile is stored (bf16 and fp16).

The FFN's plain ops on a GPU write the (N, 4d) pre-activation and read it back for GELU: one pass over the
largest tensor of the layer, ~0.19 ms of 1.25 at 65,536 tokens in bf16 on an H200 (issue 18). cuBLASLt's
GELU epilogue does this pass away where its GELU is the tanh form (kernels/cuda.py checks); where it is not,
this kernel is the other way. It accumulates in fp32 (tl.dot on the tensor cores), adds the bias and applies
0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3))) in fp32, then rounds once to the output dtype, as the plain
ops round the GEMM's output before GELU: so it is within the dtype's tolerance of them, not bit for bit.
Configurations are tried once per (N, K) (not per token count, so a new batch size never retunes, and never
inside a CUDA graph capture); kernels/cuda.py times the whole FFN through it against the other paths and keeps
the fastest per dtype, shape and token bucket. fp32 is not served (tl.dot would round to TF32).
"""

import torch

from .probe import runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs (CI)
    triton = None

MIN_TOKENS = 1024  # below this the GEMMs are small enough that a new kernel buys nothing; cuBLAS keeps them


def available(x2) -> bool:
    """Whether the kernel may serve x2: CUDA, bf16 or fp16, at least MIN_TOKENS rows, Triton working there."""
    return (x2.dtype in (torch.bfloat16, torch.float16) and x2.shape[0] >= MIN_TOKENS
            and runs_on(x2.device, _check, triton is not None))


if triton is not None:

    @triton.autotune(
        configs=[triton.Config({"BM": 128, "BN": 256, "BK": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
                 triton.Config({"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8}, num_stages=4, num_warps=8),
                 triton.Config({"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
                 triton.Config({"BM": 64, "BN": 256, "BK": 64, "GROUP_M": 8}, num_stages=4, num_warps=4)],
        key=["N", "K"])
    @triton.jit(do_not_specialize=["M"])
    def _gemm_bias_gelu(X, W, B, Y, M, N, K, s_xm, s_wk, s_ym,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        per_group = GROUP_M * tiles_n  # programs that share GROUP_M row tiles: their x rows stay in L2
        first_m = pid // per_group * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        xp = X + rm[:, None].to(tl.int64) * s_xm + rk[None, :]
        wp = W + rk[:, None].to(tl.int64) * s_wk + rn[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            left = K - k * BK
            a = tl.load(xp, mask=(rm[:, None] < M) & (rk[None, :] < left), other=0.0)
            b = tl.load(wp, mask=(rk[:, None] < left) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
            xp += BK
            wp += BK * s_wk
        h = acc + tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        inner = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        y = 0.5 * h * (2.0 * tl.sigmoid(2.0 * inner))  # 1 + tanh(u) = 2 sigmoid(2u)
        yp = Y + rm[:, None].to(tl.int64) * s_ym + rn[None, :]
        tl.store(yp, y.to(Y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm_bias_gelu(x2, w, b):
    """GELU_tanh(x2 @ w + b): x2 (M, K) with rows contiguous, w (K, N) row-major (Conv1D's layout), b (N,)."""
    M, K = x2.shape
    N = w.shape[1]
    if x2.stride(1) != 1 or w.stride(1) != 1 or w.shape[0] != K or b.shape != (N,):
        raise ValueError(f"gemm_bias_gelu: x {tuple(x2.shape)} (rows contiguous), w {tuple(w.shape)} row-major, "
                         f"b {tuple(b.shape)}: expected w ({K}, N) and b (N,)")
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
    _gemm_bias_gelu[grid](x2, w, b, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0))
    return y


def fused(x2, w1, b1, w2, b2):
    """The FFN with c_fc, its bias and GELU in this kernel, then c_proj with its bias (cuBLAS)."""
    return torch.addmm(b2, gemm_bias_gelu(x2, w1, b1), w2)


def _check(dev) -> bool:
    """One small call compiles and agrees with the plain ops on this GPU (else the kernel is not offered)."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(70, 96, device=dev, generator=g, dtype=torch.bfloat16)
    w = (0.1 * torch.randn(96, 200, device=dev, generator=g)).to(torch.bfloat16)
    b = torch.randn(200, device=dev, generator=g, dtype=torch.bfloat16)
    want = torch.nn.functional.gelu(x.float() @ w.float() + b.float(), approximate="tanh")
    return ((gemm_bias_gelu(x, w, b).float() - want).abs() <= 2e-2 + 1.6e-2 * want.abs()).all()
