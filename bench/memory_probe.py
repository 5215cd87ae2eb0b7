"""Where does Ferry's extra activation memory come from on the lora workload? (diagnostic, H200)

python bench/memory_probe.py  -- prints peak GPU memory for a 4-block, 16k-token lora model per variant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.utils.checkpoint as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import offload_bench as B

from offload import OffloadOptions, OffloadTrainingManager


def peak(model, manager, reentrant=False, tokens=16384, steps=3) -> str:
    def fwd(x):
        for block in model.blocks:
            x = cp.checkpoint(block, x, use_reentrant=reentrant)
        return x

    report = []
    for _ in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        x = torch.randn(tokens // 4096, 4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        loss = fwd(x).float().pow(2).mean()
        after_forward = torch.cuda.memory_allocated() - base
        loss.backward()
        del loss
        if manager:
            manager.after_backward()
        torch.cuda.synchronize()
        report.append(
            f"fwd {after_forward / 2**30:.2f}/peak {(torch.cuda.max_memory_allocated() - base) / 2**30:.2f}"
            f"/left {(torch.cuda.memory_allocated() - base) / 2**30:.2f}"
        )
    return " | ".join(report)


def main() -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = B.LoraModel(depth=int(sys.argv[1]) if len(sys.argv) > 1 else 4)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, device="cuda", dtype=p.dtype) * 0.02)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    print(f"weights {weights:.2f} GiB")
    model.cuda()
    print(f"resident non-reentrant: {peak(model, None)} GiB above weights")
    model.cpu()
    for name, opts, reentrant in [
        ("seed", OffloadOptions(prefetch=0, reuse_ring_slots=False), False),
        ("seed reentrant", OffloadOptions(prefetch=0, reuse_ring_slots=False), True),
        ("default", OffloadOptions(), False),
        ("block", OffloadOptions(granularity="block"), False),
    ]:
        manager = OffloadTrainingManager(model, "cuda", options=opts)
        print(
            f"ferry {name}: {peak(model, manager, reentrant)} GiB (engine peak "
            f"{manager.stats().peak_device_bytes / 2**30:.2f})"
        )
        manager.remove()


if __name__ == "__main__":
    main()
