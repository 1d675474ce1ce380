"""CUDA paths of phalanx on one GPU: correctness of each precision against fp32, and single-GPU
phalanx against the raw loop. Run by benchmarks/gpu_check.sh; prints a table last.

    python benchmarks/gpu_check.py [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import phalanx
from phalanx.demo.digits import DigitsCNN, train_test_split

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from overhead import make_data, make_model  # noqa: E402  (the same MLP workload as on CPU)


def digits_accuracy(mode: str, epochs: int) -> tuple[float, float]:
    """Train the demo CNN on the GPU in one precision; returns (test accuracy, final loss)."""
    session = phalanx.Session(phalanx.Config(), strategy="single", precision=mode, train={"epochs": epochs, "progress": False})
    train_set, test_set = train_test_split()
    model = DigitsCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = DataLoader(train_set, batch_size=64, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=256)
    model, optimizer, loader, test_loader = session.setup(model, optimizer, loader, test_loader)
    assert loader.non_blocking and loader.loader.pin_memory, "pinned, non-blocking copies expected on CUDA"
    for _ in session.epochs():
        for x, y in loader:
            with session.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                session.backward(loss)
    model.eval()
    with torch.no_grad():
        hits = torch.cat([session.gather_for_metrics((model(x).argmax(1) == y).float()) for x, y in test_loader])
    session.close()
    return hits.mean().item(), loss.item()


def throughput(use_phalanx: bool, steps: int, micro: int, mode: str, compile_model: bool = False) -> float:
    device = torch.device("cuda")
    data = make_data(micro * (steps + 10))
    model = make_model()
    if compile_model:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(data, batch_size=micro, shuffle=True, pin_memory=True)
    if use_phalanx:
        session = phalanx.Session(phalanx.Config(), strategy="single", precision=mode, train={"progress": False})
        model, optimizer, loader = session.setup(model, optimizer, loader)

        def step(x, y):
            with session.accumulate(model):
                session.backward(F.cross_entropy(model(x), y))
    else:
        model = model.to(device)
        dtype = {"fp32": None, "bf16": torch.bfloat16}[mode]

        def step(x, y):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                out = model(x)
            F.cross_entropy(out.float(), y).backward()
            optimizer.step()

    start = None
    for i, (x, y) in enumerate(loader):
        if i == 10:
            torch.cuda.synchronize()
            start = time.perf_counter()
        step(x, y)
    torch.cuda.synchronize()
    return steps * micro / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--micro-batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible")
    name = torch.cuda.get_device_name(0)
    rows = []
    base_acc, _ = digits_accuracy("fp32", args.epochs)
    for mode in ("fp32", "bf16", "fp16"):
        acc, loss = digits_accuracy(mode, args.epochs)
        ok = acc >= 0.95 and abs(acc - base_acc) <= 0.02
        rows.append((f"digits CNN {mode}", f"test accuracy {acc:.4f} (fp32 {base_acc:.4f}), loss {loss:.4f}", "ok" if ok else "FAIL"))
    for mode in ("fp32", "bf16"):
        raw, ours = [], []
        for _ in range(args.repeats):  # alternate the contenders
            raw.append(throughput(False, args.steps, args.micro_batch, mode))
            ours.append(throughput(True, args.steps, args.micro_batch, mode))
        r, p = statistics.median(raw), statistics.median(ours)
        rows.append((f"MLP {mode} raw loop", f"{r:,.0f} samples/s", "-"))
        rows.append((f"MLP {mode} phalanx", f"{p:,.0f} samples/s ({p / r:.3f}x raw)", "ok" if p / r >= 0.95 else "SLOW"))
    compiled = throughput(True, args.steps, args.micro_batch, "bf16", compile_model=True)
    rows.append(("MLP bf16 phalanx + torch.compile", f"{compiled:,.0f} samples/s", "ok"))

    print(f"\nphalanx GPU check on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    width = max(len(r[0]) for r in rows)
    for check, figure, verdict in rows:
        print(f"{check:<{width}}  {verdict:5s} {figure}")
    if any(v == "FAIL" for _, _, v in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
