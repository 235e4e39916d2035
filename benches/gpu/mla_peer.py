"""The PyTorch peers of kiln's MLA kernels, on the same GPU. Prints tables and writes JSON
to argv[1]; with argv[2] (the `mla_decode` JSON of the same run) it also prints kiln's time
for each decode shape beside the peer's, and their ratio. `mla_peer.py prefill OUT.json
[MLA_PREFILL.json]` runs the prefill points alone, beside `mla_prefill`'s forms.

Prefill/extend: SDPA (bf16, causal) on the unabsorbed problem kiln's absorbed kernel
replaces (Kimi K2: 64 heads, q/k head dim 128 + 64 rope = 192, v 128), as SGLang and vLLM
run MLA prefill. The new tokens sit at the end of the context (a cached prefix of ctx - q
tokens), so query i sees positions 0..=ctx - q + i: with no prefix that is SDPA's is_causal;
with one, the mask is passed explicitly (bool, q x ctx). TFLOP/s counts the visible (query,
key) pairs x 2 x heads x (192 + 128), the work SDPA must do.

Decode (one token per request, bf16 KV): the absorbed form over each request's contiguous
latent cache (576 values a position, the first 512 of them the values), as plain PyTorch
writes it: scores = q K^T (cuBLAS batched GEMM), softmax in f32, weights V (a second
GEMM), timed eagerly and as CUDA graphs; the faster is the peer. Contiguous, not paged: the
peer is spared the page gather kiln does. Several cache copies are rotated (>= 256 MB in
all) so L2 never holds the next call's KV, as in `mla_decode`. TB/s counts the same bytes as
`mla_decode` (1152 per visible position).
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


DECODE_SHAPES = [  # (heads, batch, context): mla_decode's decode grid
    (h, b, c)
    for h in (16, 64)
    for b, c in [(1, 8192), (1, 32768), (1, 100000), (1, 131072), (8, 32768), (8, 100000),
                 (32, 32768), (32, 100000), (64, 32768), (64, 49152)]
]


def decode_point(heads, batch, ctx):
    row_bytes = 576 * 2
    copies = max(1, min(32, -(-256_000_000 // (batch * ctx * row_bytes))))
    caches = [torch.randn(batch, ctx, 576, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    q = torch.randn(batch, heads, 576, device="cuda", dtype=torch.bfloat16)
    scale = 192 ** -0.5

    def step(kv):
        scores = torch.matmul(q, kv.transpose(1, 2))
        weights = torch.softmax(scores.float() * scale, dim=-1).to(torch.bfloat16)
        return torch.matmul(weights, kv[..., :512])

    # Each timed run makes `calls` back-to-back calls over the copies in turn, so the device
    # is not left waiting on the host between them (kiln's figures are device time too).
    calls = max(copies, 4)

    def rotating(call):
        def run():
            for i in range(calls):
                call(i % copies)

        return run

    eager_ms = time_ms(rotating(lambda i: step(caches[i]))) / calls
    # The same three steps captured as CUDA graphs (one per cache copy), as a serving
    # engine runs decode: the launches' host time no longer counts.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(caches[0])
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for kv in caches:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=graphs[0].pool() if graphs else None):
            step(kv)
        graphs.append(g)
    graph_ms = time_ms(rotating(lambda i: graphs[i].replay())) / calls
    del caches, graphs
    torch.cuda.empty_cache()
    ms = min(eager_ms, graph_ms)
    tbps = batch * ctx * row_bytes / (ms * 1e-3) / 1e12
    return {
        "heads": heads,
        "batch": batch,
        "context": ctx,
        "eager_us": eager_ms * 1e3,
        "graph_us": graph_ms * 1e3,
        "us": ms * 1e3,
        "tbps": tbps,
    }


def prefill_points(kiln_json=None):
    """SDPA's prefill points; beside each, kiln's forms from `mla_prefill`'s JSON of the
    same run (ratio: SDPA's ms over kiln's, so 1.0 is parity and more is faster)."""
    prefill = [point(q, c) for q, c in [(8192, 8192), (8192, 32768)]]
    kiln = []
    if kiln_json:
        with open(kiln_json) as f:
            kiln = json.load(f)
    print(f"{'q':>6} {'ctx':>6} {'SDPA ms':>9} {'TFLOP/s':>8}   kiln form: ms (x SDPA speed)")
    for p in prefill:
        forms = [k for k in kiln if (k["q_len"], k["context"]) == (p["q_len"], p["context"])]
        for k in forms:
            p[k["form"]] = {"ms": k["ms"], "x_sdpa": p["ms"] / k["ms"]}
        tail = "  ".join(f"{k['form']}: {k['ms']:.2f} ({p['ms'] / k['ms']:.2f}x)" for k in forms)
        print(f"{p['q_len']:>6} {p['context']:>6} {p['ms']:>9.3f} {p['tflops']:>8.1f}   {tail}")
    return prefill


def main():
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if sys.argv[1:2] == ["prefill"]:
        # `mla_peer.py prefill OUT.json [MLA_PREFILL.json]`: the prefill points alone.
        prefill = prefill_points(sys.argv[3] if len(sys.argv) > 3 else None)
        with open(sys.argv[2], "w") as f:
            json.dump({"prefill": prefill}, f, indent=2)
        return
    prefill = prefill_points()
    decode = [decode_point(*shape) for shape in DECODE_SHAPES]
    kiln = {}
    if len(sys.argv) > 2:
        with open(sys.argv[2]) as f:
            for k in json.load(f):
                if k["kv"] == "bf16" and k["q_len"] == 1:
                    kiln[(k["heads"], k["batch"], k["context"])] = k
    print("decode, bf16 KV: torch matmul + softmax + matmul (the faster of eager and a CUDA")
    print("graph) against kiln's device time from the same run")
    print(f"{'H':>3} {'B':>3} {'ctx':>7} {'eager us':>9} {'graph us':>9} {'TB/s':>6} {'kiln us':>9} {'TB/s':>6} {'speedup':>8}")
    for p in decode:
        k = kiln.get((p["heads"], p["batch"], p["context"]))
        if k:
            p["kiln_us"] = k["us"]
            p["speedup"] = p["us"] / k["us"]
        tail = f"{k['us']:>9.1f} {k['tbps']:>6.2f} {p['speedup']:>8.2f}" if k else f"{'-':>9} {'-':>6} {'-':>8}"
        print(
            f"{p['heads']:>3} {p['batch']:>3} {p['context']:>7} {p['eager_us']:>9.1f} "
            f"{p['graph_us']:>9.1f} {p['tbps']:>6.2f} {tail}"
        )
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"prefill": prefill, "decode": decode}, f, indent=2)


if __name__ == "__main__":
    main()
