"""CUDA paths of phalanx on one GPU, run by benchmarks/gpu_check.sh; prints a table last.

- bf16 and fp16 (autocast, GradScaler) against fp32: digits CNN accuracy, and the MLP's losses and
  weight updates over the same batches;
- the side-stream prefetcher (data.prefetch_to_device): the same batches as the plain copy, with
  and without loader workers, and its time against the plain copy on two copy-heavy toys;
- torch.compile against eager: losses and weights over the same batches, then its speed;
- single-GPU phalanx against the raw loop, samples/s.

    python benchmarks/gpu_check.py [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import phalanx
from phalanx.demo.digits import DigitsCNN, train_test_split

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from overhead import IN, OUT, make_data, make_model  # noqa: E402  (the same MLP workload as on CPU)


def digits_accuracy(mode: str, epochs: int) -> tuple[float, float]:
    """Train the demo CNN on the GPU in one precision; returns (test accuracy, final loss)."""
    session = phalanx.Session(
        phalanx.Config(), strategy="single", precision=mode, train={"epochs": epochs, "progress": False}
    )
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


def single_gpu_session(**sections) -> phalanx.Session:
    """One process on the GPU, no bar or summary, and never a resume from a checkpoints/ directory lying around."""
    return phalanx.Session(
        phalanx.Config(),
        strategy="single",
        train={"progress": False, "metrics": False},
        checkpoint={"resume": "never"},
        **sections,
    )


def teacher_data(n: int) -> TensorDataset:
    """Inputs labelled by a fixed random linear teacher: learnable, so the gradients carry signal
    (with random labels they are mostly noise, and any rounding moves them by several percent)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, IN, generator=g)
    return TensorDataset(x, (x @ torch.randn(IN, OUT, generator=g)).argmax(1))


def train_losses(session: phalanx.Session, model: nn.Module, loader) -> list[float]:
    """One pass over ``loader`` with cross-entropy, the loss of every step."""
    losses = []
    for x, y in loader:
        with session.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            session.backward(loss)
        losses.append(loss.item())
    return losses


def precision_run(mode: str, steps: int, micro: int) -> dict:
    """The overhead MLP for ``steps`` optimizer steps on fixed batches, with gradient clipping (so
    fp16 unscales before it); losses, the weight update and the dtype the first layer computed in."""
    session = single_gpu_session(precision=mode, batch={"global_batch_size": micro}, optim={"max_grad_norm": 1.0})
    model = make_model()
    initial = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    dtypes = []
    model[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_loader(DataLoader(teacher_data(micro * steps), batch_size=micro, shuffle=False), train=True)
    losses = train_losses(session, model, loader)
    update = torch.cat([p.detach().flatten().float().cpu() for p in session.unwrap(model).parameters()]) - initial
    scaler = session.precision.scaler
    out = {
        "losses": losses,
        "update": update,
        "dtype": dtypes[0],
        "stepped": session.step_count,
        "scale": scaler.get_scale() if scaler else None,
    }
    session.close()
    return out


def precision_rows(steps: int, micro: int) -> list[tuple[str, str, str]]:
    want = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    # Relative difference of the weight update to fp32's. On this project's CPU (torch 2.13, same
    # workload, 256 per batch) it was 4.8% for bf16 and 2.9% for fp16. Gradients the scaler
    # left scaled would be clipped to norm 1, several times fp32's, and be far off.
    tolerance = {"bf16": 0.15, "fp16": 0.15}
    base = precision_run("fp32", steps, micro)
    rows = []
    for mode in ("bf16", "fp16"):
        run = precision_run(mode, steps, micro)
        last, base_last = statistics.mean(run["losses"][-5:]), statistics.mean(base["losses"][-5:])
        loss_ok = abs(last - base_last) <= 0.02 * base_last + 0.01
        skipped = steps - run["stepped"]
        figure = f"autocast {str(run['dtype']).removeprefix('torch.')}, loss {last:.4f} (fp32 {base_last:.4f})"
        ok = run["dtype"] == want[mode] and loss_ok
        if mode == "fp16":
            scale = run["scale"]
            ok = ok and scale is not None and 0 < scale < float("inf")
            figure += f", GradScaler scale {scale:g}, {skipped} step(s) skipped"
        if not skipped:  # a skipped step leaves the weights a step behind: only the losses compare then
            rel = ((run["update"] - base["update"]).norm() / base["update"].norm()).item()
            ok = ok and rel <= tolerance[mode]
            figure += f", weight update {rel:.2%} from fp32's (max {tolerance[mode]:.0%})"
        rows.append((f"MLP {mode} vs fp32, {steps} steps", figure, "ok" if ok else "FAIL"))
    return rows


def prefetch_batches(prefetch: bool, workers: int) -> tuple[list, tuple[str, bool]]:
    """Every batch of two shuffled epochs as the training loop receives it."""
    session = single_gpu_session(data={"num_workers": workers, "prefetch_to_device": prefetch})
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(
        torch.randint(0, 256, (640, 3, 64, 64), dtype=torch.uint8, generator=g),
        torch.randint(0, 10, (640,), generator=g),
    )
    loader = session.setup(DataLoader(data, batch_size=64, shuffle=True))
    kind = (type(loader.transfer).__name__, loader.fetch_ahead)
    batches = []
    for _ in session.epochs(2):
        for x, y in loader:
            batches.append((x.float().mul(2).sum().item(), x.clone(), y.clone()))  # read on the compute stream first
    session.close()
    return batches, kind


def prefetch_identity_rows() -> list[tuple[str, str, str]]:
    rows = []
    for workers in (0, 2):
        plain, plain_kind = prefetch_batches(False, workers)
        fast, fast_kind = prefetch_batches(True, workers)
        same = len(plain) == len(fast) == 20 and all(
            a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(plain, fast)
        )
        paths_ok = plain_kind == ("PlainTransfer", False) and fast_kind == ("StreamTransfer", workers > 0)
        figure = f"{len(fast)} batches identical to the plain copy" if same else "batches DIFFER from the plain copy"
        figure += f" ({'next batch fetched ahead' if fast_kind[1] else 'copied when asked for'})"
        rows.append((f"prefetch to device, {workers} workers", figure, "ok" if same and paths_ok else "FAIL"))
    return rows


class Cycled(Dataset):
    """``length`` samples read round-robin from a smaller dataset (a long epoch without the memory)."""

    def __init__(self, data: Dataset, length: int):
        self.data, self.length = data, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return self.data[i % len(self.data)]


def copy_heavy_model() -> nn.Module:
    # Little compute per byte of input, so the host-to-device copy is a large part of each step.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def loader_step_time(prefetch: bool, toy: str, steps: int, warmup: int = 10) -> float:
    """Seconds per step of one of two copy-heavy toys, with or without the side-stream copy.

    pinned: 128 float images of 3x128x128 per batch (25 MB), already in pinned memory (as a
    loader that decodes into pinned buffers hands them over), loaded in the training process;
    the loop never waits for the GPU, as phalanx's loops do not.
    workers: 64 such images per batch from 4 worker processes, pinned by the DataLoader; the loop
    reads its loss every step (loss.item()), so only a batch fetched ahead can overlap.
    """
    session = single_gpu_session(data={"prefetch_to_device": prefetch})
    g = torch.Generator().manual_seed(3)
    if toy == "pinned":
        micro, workers = 128, 0
        pool = [
            (
                torch.randn(micro, 3, 128, 128, generator=g).pin_memory(),
                torch.randint(0, 10, (micro,), generator=g).pin_memory(),
            )
            for _ in range(8)
        ]
        data = TensorDataset(torch.arange(micro * (warmup + steps)))

        def collate(items):
            return pool[int(items[0][0]) % len(pool)]

        raw = DataLoader(data, batch_size=micro, shuffle=True, collate_fn=collate)
    else:
        micro, workers = 64, 4
        data = Cycled(
            TensorDataset(torch.randn(512, 3, 128, 128, generator=g), torch.randint(0, 10, (512,), generator=g)),
            micro * (warmup + steps),
        )
        raw = DataLoader(data, batch_size=micro, shuffle=True, num_workers=workers)
    model = copy_heavy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = session.setup(model, optimizer, raw)
    assert loader.loader.num_workers == workers and (loader.fetch_ahead == (prefetch and workers > 0))
    start = None
    for i, (x, y) in enumerate(loader):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        if i == warmup + steps:
            break
        with session.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            session.backward(loss)
        if toy == "workers":
            loss.item()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    session.close()
    return seconds


def prefetch_speed_rows(steps: int, repeats: int) -> list[tuple[str, str, str]]:
    rows = []
    for toy in ("pinned", "workers"):
        plain, fast = [], []
        for _ in range(repeats):  # alternate the contenders
            plain.append(loader_step_time(False, toy, steps))
            fast.append(loader_step_time(True, toy, steps))
        p, f = statistics.median(plain), statistics.median(fast)
        figure = f"{f * 1e3:.2f} ms/step with prefetch, {p * 1e3:.2f} without ({p / f:.2f}x)"
        rows.append((f"prefetch speed, {toy} toy", figure, "ok" if p / f >= 0.97 else "SLOW"))
    return rows


def compile_run(compiled: bool, steps: int, micro: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    session = single_gpu_session(batch={"global_batch_size": micro}, compute={"compile": compiled})
    base = make_model()
    optimizer = torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = session.setup(base, optimizer)
    loader = session.setup_loader(DataLoader(make_data(micro * steps), batch_size=micro, shuffle=False), train=True)
    losses = train_losses(session, model, loader)
    weights = {k: v.detach().cpu().clone() for k, v in base.state_dict().items()}
    session.close()
    return losses, weights


def compile_rows(steps: int, micro: int) -> list[tuple[str, str, str]]:
    eager_losses, eager = compile_run(False, steps, micro)
    started = time.perf_counter()
    compiled_losses, compiled = compile_run(True, steps, micro)
    took = time.perf_counter() - started
    loss_diff = max(abs(a - b) for a, b in zip(eager_losses, compiled_losses))
    weight_diff = max(
        ((compiled[k] - eager[k]).abs().max() / eager[k].abs().max().clamp_min(1e-12)).item() for k in eager
    )
    ok = len(compiled_losses) == len(eager_losses) == steps and loss_diff <= 1e-4 and weight_diff <= 1e-3
    figure = (
        f"{steps} steps: loss differs by {loss_diff:.1e} at most, weights by {weight_diff:.1e} (relative); "
        f"compiling and running took {took:.0f}s"
    )
    return [("MLP fp32 compute.compile vs eager", figure, "ok" if ok else "FAIL")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--micro-batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            f"gpu_check: no CUDA device visible (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda or 'none'}); run it on a machine with a GPU"
        )
    name = torch.cuda.get_device_name(0)
    rows = []
    base_acc, _ = digits_accuracy("fp32", args.epochs)
    for mode in ("fp32", "bf16", "fp16"):
        acc, loss = digits_accuracy(mode, args.epochs)
        ok = acc >= 0.95 and abs(acc - base_acc) <= 0.02
        rows.append(
            (
                f"digits CNN {mode}",
                f"test accuracy {acc:.4f} (fp32 {base_acc:.4f}), loss {loss:.4f}",
                "ok" if ok else "FAIL",
            )
        )
    rows += precision_rows(30, args.micro_batch)
    rows += prefetch_identity_rows()
    rows += prefetch_speed_rows(100, args.repeats)
    rows += compile_rows(20, args.micro_batch)
    for mode in ("fp32", "bf16"):
        raw, ours = [], []
        for _ in range(args.repeats):  # alternate the contenders
            raw.append(throughput(False, args.steps, args.micro_batch, mode))
            ours.append(throughput(True, args.steps, args.micro_batch, mode))
        r, p = statistics.median(raw), statistics.median(ours)
        rows.append((f"MLP {mode} raw loop", f"{r:,.0f} samples/s", "-"))
        rows.append(
            (f"MLP {mode} phalanx", f"{p:,.0f} samples/s ({p / r:.3f}x raw)", "ok" if p / r >= 0.95 else "SLOW")
        )
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
