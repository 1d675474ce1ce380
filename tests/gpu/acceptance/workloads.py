"""Models, data and Sessions the parts share; small, so the whole check stays within minutes."""

from __future__ import annotations

import contextlib
import io
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import phalanx

# The MLP 4x1024 of the CPU benchmarks (benchmarks/mlp_workload.py), repeated here so that the GPU
# tier does not import benchmark scripts: the same seeds give the same weights and data.
IN, HIDDEN, OUT = 256, 1024, 10


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers, width = [], IN
    for _ in range(4):
        layers += [nn.Linear(width, HIDDEN), nn.ReLU()]
        width = HIDDEN
    return nn.Sequential(*layers, nn.Linear(width, OUT))


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


# Where the hand-written loops and warm-ups run. run.py --cpu-smoke sets the CPU, to try the
# script itself on a machine without a GPU (its figures then mean nothing).
DEVICE = torch.device("cuda")


def on_cuda() -> bool:
    return DEVICE.type == "cuda"


def sync() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def reset_peak() -> None:
    if on_cuda():
        torch.cuda.reset_peak_memory_stats()


def allocated() -> int:
    return torch.cuda.memory_allocated() if on_cuda() else 0


def peak_allocated() -> int:
    return torch.cuda.max_memory_allocated() if on_cuda() else 0


def empty_cache() -> None:
    if on_cuda():
        torch.cuda.empty_cache()


def device_name() -> str:
    return torch.cuda.get_device_name(0) if on_cuda() else "cpu"


def session(strategy: str | dict = "single", **sections) -> phalanx.Session:
    """One process on the GPU, no bar or metrics, and never a resume from a checkpoints/ directory
    lying around."""
    train = {"progress": False, "metrics": False} | sections.pop("train", {})
    return phalanx.Session(phalanx.Config(), strategy=strategy, train=train, checkpoint={"resume": "never"}, **sections)


@contextlib.contextmanager
def quiet():
    """Swallow what Sessions print (start-up lines, summaries), so the table stays readable."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def teacher_data(n: int, features: int = IN, classes: int = OUT, seed: int = 4) -> TensorDataset:
    """Inputs labelled by a fixed random linear teacher: learnable, so the gradients carry signal
    (with random labels they are mostly noise, and any rounding moves them by several percent)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, (x @ torch.randn(features, classes, generator=g)).argmax(1))


class Batched(Dataset):
    """``length`` samples read round-robin from a pool, a whole batch per fetch (``__getitems__``),
    so loading costs one indexing per step instead of one per sample and the GPU, not the
    loader, sets the pace."""

    def __init__(self, pool: TensorDataset, length: int):
        self.x, self.y = pool.tensors
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return self.x[i % len(self.x)], self.y[i % len(self.y)]

    def __getitems__(self, indices: list[int]):
        at = torch.as_tensor(indices) % len(self.x)
        return self.x[at], self.y[at]


def whole_batch(batch):
    """collate_fn for :class:`Batched`: the fetch already is the batch (module level: picklable)."""
    return batch


def batched_loader(pool: TensorDataset, length: int, batch_size: int, **kwargs) -> DataLoader:
    return DataLoader(Batched(pool, length), batch_size=batch_size, collate_fn=whole_batch, **kwargs)


def mlp(features: int, width: int, depth: int, classes: int = OUT, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers, inputs = [], features
    for _ in range(depth):
        layers += [nn.Linear(inputs, width), nn.ReLU()]
        inputs = width
    return nn.Sequential(*layers, nn.Linear(inputs, classes))


@dataclass
class Trained:
    losses: list[float]
    update: torch.Tensor  # final minus initial weights, flattened, fp32 on the CPU
    weights: dict[str, torch.Tensor]
    dtype: torch.dtype | None  # what the first layer computed in
    stepped: int
    session: phalanx.Session  # closed
    held: set[tuple[str, torch.dtype]]  # (device type, dtype) of the parameters this process stores


def train_mlp(
    steps: int, micro: int, *, optimizer: str = "sgd", lr: float = 0.05, strategy: str | dict = "single", **sections
) -> Trained:
    """The MLP 4x1024 on teacher data, fixed batches in order, one optimizer step per batch."""
    with quiet():
        run = session(strategy, batch={"global_batch_size": micro}, **sections)
        model = make_model()
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        dtypes = []
        model[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
        if optimizer == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=lr)
        model, opt = run.setup(model, opt)
        data = DataLoader(teacher_data(micro * steps), batch_size=micro, shuffle=False)
        losses = train_losses(run, model, run.setup_loader(data, train=True))
        weights = {k: v.detach().float().cpu() for k, v in run.model_state_dict().items()}
        held = {(local(p).device.type, p.dtype) for p in run.unwrap(model).parameters()}
        run.close()
    update = torch.cat([(weights[k] - initial[k]).flatten() for k in initial])
    return Trained(losses, update, weights, dtypes[0] if dtypes else None, run.step_count, run, held)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (FSDP's parameters), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def train_losses(run: phalanx.Session, model: nn.Module, loader) -> list[float]:
    """One pass over ``loader`` with cross-entropy, the loss of every step."""
    losses = []
    for x, y in loader:
        with run.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
        losses.append(loss.item())
    return losses


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of any tensor, relative to that tensor's largest value in ``b``."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)


def window_gap(losses: list[float], reference: list[float], window: int = 5) -> float:
    """The largest relative gap between the mean losses of consecutive windows of steps."""
    gaps = []
    for i in range(0, len(reference) - window + 1, window):
        ours, theirs = statistics.mean(losses[i : i + window]), statistics.mean(reference[i : i + window])
        gaps.append(abs(ours - theirs) / theirs)
    return max(gaps)
