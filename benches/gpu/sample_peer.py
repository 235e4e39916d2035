"""PyTorch's sampling of the shapes `sample` (kiln's device sampler bench) times, on the same
GPU, as serving engines written in PyTorch sample: greedy is argmax; temperature is softmax
then torch.multinomial; top-p/top-k is vLLM's sort-based filter (sort the row, mask the
tail past top-k and past the cumulative top-p, then softmax + multinomial). Rows of Kimi
K2's vocabulary (163,840), f32, batches 1, 8, 32, 64; each timed with CUDA events over 20
calls (median of 5), so launch costs are counted as a served step pays them.

Prints a table and writes JSON to argv[1]; with argv[2] (the `sample` JSON of the same run)
also kiln's device time beside the peer's and their ratio.
"""
import json
import sys

import torch

VOCAB = 163_840
BATCHES = [1, 8, 32, 64]
CALLS = 20


def time_us(fn):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    times.sort()
    return times[len(times) // 2]


def greedy(logits):
    return logits.argmax(dim=-1)


def temperature(logits):
    return torch.multinomial(torch.softmax(logits / 0.7, dim=-1), 1)


def filtered(logits, t=0.7, top_p=0.95, top_k=40):
    sorted_logits, order = (logits / t).sort(dim=-1, descending=False)
    cut = sorted_logits.size(-1) - top_k
    kth = sorted_logits.gather(-1, torch.full((logits.size(0), 1), cut, device=logits.device))
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mask = probs.cumsum(dim=-1) <= 1 - top_p
    mask[:, -1] = False
    sorted_logits.masked_fill_(mask, float("-inf"))
    probs = torch.zeros_like(sorted_logits).scatter_(-1, order, sorted_logits.softmax(dim=-1))
    return torch.multinomial(probs, 1)


def flat(logits):
    return filtered(logits, t=1.0, top_p=0.5, top_k=VOCAB)


def main():
    points = []
    gen = torch.Generator(device="cuda").manual_seed(1206)
    for name, fn in [("greedy", greedy), ("temperature", temperature), ("filtered", filtered), ("flat", flat)]:
        for b in BATCHES:
            x = torch.randn(b, VOCAB, device="cuda", generator=gen) * 1.5
            if name == "flat":
                x *= 0.01
            else:
                x[:, :5] += torch.tensor([12.0, 10.5, 10.0, 9.0, 8.0], device="cuda")
            points.append({"kind": name, "batch": b, "torch_us": time_us(lambda: fn(x))})
    kiln = {}
    if len(sys.argv) > 2:
        kiln = {(p["kind"], p["batch"]): p["device_us"] for p in json.load(open(sys.argv[2]))}
    print(f"{'kind':<11} {'B':>3} {'torch us':>9} {'kiln us':>8} {'kiln/torch':>10}")
    for p in points:
        k = kiln.get((p["kind"], p["batch"]))
        if k is not None:
            p["kiln_us"] = k
            p["ratio"] = k / p["torch_us"]
        cells = [f"{p['kind']:<11}", f"{p['batch']:>3}", f"{p['torch_us']:>9.1f}"]
        cells += [f"{k:>8.1f}", f"{k / p['torch_us']:>10.2f}"] if k is not None else []
        print(" ".join(cells))
    json.dump(points, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
