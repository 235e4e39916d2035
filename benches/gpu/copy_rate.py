#!/usr/bin/env python3
"""The card's device-to-device copy rate in bytes/s (read + written, 8 GiB buffers, as
ANCHORS.md measured the H200's 4.30 TB/s): the denominator of a floor on whatever card a
device call lands on. With --host, the host link's instead: pinned host memory to the
device and back, 2 GiB each way (the ceiling of the KV host tier's copies). Prints the
card's name and the rates as JSON.

    benches/gpu/copy_rate.py > copy.json
    benches/gpu/copy_rate.py --host > copy.json
"""
import json
import sys

import torch


def seconds_per_copy(dst, src, reps):
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


result = {"gpu": torch.cuda.get_device_name()}
if sys.argv[1:2] == ["--host"]:
    host = torch.empty(2 << 30, dtype=torch.uint8).pin_memory()
    device = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    result["host_to_device_bytes_per_s"] = host.numel() / seconds_per_copy(device, host, 10)
    result["device_to_host_bytes_per_s"] = host.numel() / seconds_per_copy(host, device, 10)
else:
    src = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    result["copy_bytes_per_s"] = 2 * src.numel() / seconds_per_copy(dst, src, 20)
print(json.dumps(result))
