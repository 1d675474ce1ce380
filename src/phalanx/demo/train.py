"""phalanx's demo: train a small CNN on the digits on every device, then report test accuracy.

Run it with ``phalanx demo`` (which launches this file on every device), or
``phalanx launch src/phalanx/demo/train.py``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import phalanx
from phalanx.demo.digits import DigitsCNN, train_test_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=None, help="epochs (default: train.epochs, 12 for the demo)")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help=(
            "stop training after this many optimizer steps, over as many epochs as that takes "
            "(phalanx bench's short runs)"
        ),
    )
    args = parser.parse_args()

    # Code defaults for the demo: they beat phalanx.yaml, and `--set train.epochs=N` beats them.
    session = phalanx.Session(train={"epochs": args.epochs or 12})
    train_set, test_set = train_test_split()
    model = DigitsCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=128, shuffle=False)
    steps = args.max_steps or session.config.train.epochs * -(-len(train_set) // 64)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    model, optimizer, train_loader, test_loader, scheduler = session.setup(
        model, optimizer, train_loader, test_loader, scheduler
    )

    epochs = None
    if args.max_steps:
        # Known only after setup: the loader's length is in micro-batches of this process.
        steps_per_epoch = -(-len(train_loader) // session.accumulation_steps)
        epochs = -(-args.max_steps // steps_per_epoch)
    samples, seconds = 0, 0.0
    for _ in session.epochs(epochs):
        model.train()
        for images, labels in session.progress(train_loader):
            with session.accumulate(model):
                session.backward(F.cross_entropy(model(images), labels))
            if session.step_count == args.max_steps:
                break
        else:  # a pass cut short leaves no throughput figure for that epoch
            samples += session.last_throughput.samples
            seconds += session.last_throughput.seconds

    model.eval()
    correct = []
    with torch.no_grad():
        for images, labels in session.progress(test_loader, "test"):
            hits = (model(images).argmax(dim=1) == labels).float()
            correct.append(session.gather_for_metrics(hits))
    correct = torch.cat(correct)
    accuracy = correct.mean().item()
    session.print(f"test accuracy {accuracy:.4f} on {correct.numel()} images ({len(test_set)} in the test set)")
    throughput = samples / seconds if seconds else None
    if throughput is not None:
        session.print(f"training throughput {throughput:,.0f} samples/s over {session.world_size} process(es)")
    session.log(test_accuracy=accuracy, test_images=correct.numel(), samples_per_s=throughput, steps=session.step_count)
    session.close()


if __name__ == "__main__":
    main()
