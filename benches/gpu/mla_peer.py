"""The peer for MLA prefill/extend: PyTorch SDPA (bf16, causal) on the unabsorbed problem
kiln's absorbed kernel replaces (Kimi K2: 64 heads, q/k head dim 128 + 64 rope = 192, v 128),
as SGLang and vLLM run MLA prefill. Prints a table and writes JSON to argv[1].

The new tokens sit at the end of the context (a cached prefix of ctx - q tokens), so query i
sees positions 0..=ctx - q + i: with no prefix that is SDPA's is_causal; with one, the mask is
passed explicitly (bool, q x ctx). TFLOP/s counts the visible (query, key) pairs x 2 x heads x
(192 + 128), the work SDPA must do.
"""
import json
import sys

import torch
import torch.nn.functional as F

HEADS, DQK, DV = 64, 192, 128


def time_ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def point(q_len, ctx):
    q = torch.randn(1, HEADS, q_len, DQK, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HEADS, ctx, DQK, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, HEADS, ctx, DV, device="cuda", dtype=torch.bfloat16)
    if q_len == ctx:
        run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        rows = torch.arange(q_len, device="cuda")[:, None] + (ctx - q_len)
        mask = torch.arange(ctx, device="cuda")[None, :] <= rows
        run = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ms = time_ms(run)
    pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) // 2
    tflops = 2 * HEADS * pairs * (DQK + DV) / (ms * 1e-3) / 1e12
    return {"q_len": q_len, "context": ctx, "ms": ms, "tflops": tflops}


def main():
    points = [point(q, c) for q, c in [(8192, 8192), (8192, 32768)]]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'q':>6} {'ctx':>6} {'ms':>9} {'TFLOP/s':>8}")
    for p in points:
        print(f"{p['q_len']:>6} {p['context']:>6} {p['ms']:>9.3f} {p['tflops']:>8.1f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(points, f, indent=2)


if __name__ == "__main__":
    main()
