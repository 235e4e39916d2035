#!/usr/bin/env python3
"""The card's device-to-device copy rate in bytes/s (read + written, 8 GiB buffers, as
ANCHORS.md measured the H200's 4.30 TB/s): the denominator of a floor on whatever card a
device call lands on. Prints the card's name and the rate as JSON.

    benches/gpu/copy_rate.py > copy.json
"""
import json

import torch

src = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
for _ in range(3):
    dst.copy_(src)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
reps = 20
start.record()
for _ in range(reps):
    dst.copy_(src)
end.record()
torch.cuda.synchronize()
seconds = start.elapsed_time(end) / 1e3 / reps
print(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_bytes_per_s": 2 * src.numel() / seconds}))
