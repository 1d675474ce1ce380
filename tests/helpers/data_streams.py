"""Data whose order matters, trained through phalanx and by a plain one-process loop, for the
equivalence tests of docs/data.md: a truncated-BPTT language model fed from a stream of columns
(``session.shard(..., micro_steps=True)``) and from an ordered training loader, an iterable
dataset, and tensors already in memory (``session.shard``). Every scenario trains on global batches
of ``G`` samples; the plain loop takes each global batch whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import phalanx
from phalanx.config.schema import Config

G = 8  # global batch: columns of the stream, samples of the other scenarios
BPTT = 5
CHUNKS = 4  # optimizer steps of the language model
VOCAB = 11
LR = 0.5


# -- the language model ---------------------------------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 6)
        self.rnn = nn.LSTM(6, 7)
        self.out = nn.Linear(7, VOCAB)

    def forward(self, tokens, hidden):  # tokens: [time, columns], sequence first
        output, hidden = self.rnn(self.embed(tokens), hidden)
        return self.out(output).reshape(-1, VOCAB), hidden


def zero_hidden(columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, columns, 7), torch.zeros(1, columns, 7)


def detached(hidden):
    return tuple(h.detach() for h in hidden)


def columns() -> torch.Tensor:
    """The token stream cut into G columns, [time, G]: column j continues from chunk to chunk."""
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (BPTT * CHUNKS + 1, G), generator=g)


def chunk(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return source[i : i + BPTT], source[i + 1 : i + 1 + BPTT].reshape(-1)


def lm_reference() -> dict[str, torch.Tensor]:
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data, hidden = columns(), zero_hidden(G)
    for i in range(0, data.size(0) - 1, BPTT):
        x, y = chunk(data, i)
        hidden = detached(hidden)
        opt.zero_grad()
        out, hidden = model(x, hidden)
        F.cross_entropy(out, y).backward()
        opt.step()
    return model.state_dict()


class Chunks(Dataset):
    """Item t*G + j: chunk t of column j, batch first ([BPTT] inputs, [BPTT] targets, and j), the
    Dataset the issue's user wrote to feed the columns through a DataLoader."""

    def __init__(self):
        self.data = columns()

    def __len__(self):
        return CHUNKS * G

    def __getitem__(self, item):
        t, j = divmod(item, G)
        x = self.data[t * BPTT : (t + 1) * BPTT, j]
        y = self.data[t * BPTT + 1 : (t + 1) * BPTT + 1, j]
        return x, y, j


def _session(micro: int | None, **batch) -> phalanx.Session:
    return phalanx.Session(
        Config(),
        batch={"global_batch_size": G, "micro_batch_size": micro, **batch},
        optim={"lr_scaling": "none"},
        train={"progress": False, "seed": 0},
        checkpoint={"dir": "checkpoints", "resume": "never"},
    )


def lm_stream(micro: int | None) -> tuple[phalanx.Session, dict]:
    session = _session(micro, fixed_layout=True)
    model = TinyLM()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    parts = session.shard(columns(), dim=1, micro_steps=True)  # this rank's columns, one piece per micro-step
    hidden = [zero_hidden(part.size(1)) for part in parts]
    for _ in session.epochs():
        for i in range(0, parts[0].size(0) - 1, BPTT):
            for m, part in enumerate(parts):
                x, y = chunk(part, i)
                with session.accumulate(model):
                    hidden[m] = detached(hidden[m])
                    out, hidden[m] = model(x, hidden[m])
                    session.backward(F.cross_entropy(out, y))
    return session, {
        "state": session.model_state_dict(),
        "steps": session.step_count,
        "widths": [p.size(1) for p in parts],
    }


def lm_ordered_loader(micro: int | None) -> tuple[phalanx.Session, dict]:
    session = _session(micro)
    model = TinyLM()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = session.setup_loader(DataLoader(Chunks(), batch_size=G), train=True, fixed_layout=True)
    hidden = [zero_hidden(session.batch.micro_batch_size) for _ in range(session.accumulation_steps)]
    seen: dict[int, list[list[int]]] = {}  # micro-step slot -> the columns it saw, step by step
    m = 0
    for _ in session.epochs():
        for x, y, j in loader:
            seen.setdefault(m, []).append(j.tolist())
            with session.accumulate(model):
                hidden[m] = detached(hidden[m])
                out, hidden[m] = model(x.t(), hidden[m])  # the model is sequence first
                session.backward(F.cross_entropy(out, y.t().reshape(-1)))
            m = (m + 1) % session.accumulation_steps
    return session, {"state": session.model_state_dict(), "steps": session.step_count, "columns": seen}


# -- an iterable dataset and tensors in memory -------------------------------------------------------------
SAMPLES = 5 * G + 3  # the last 3 do not complete a global batch: dropped


def regression(n: int = SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


class Stream(IterableDataset):
    """Samples in a fixed order, the same on every rank, and its length."""

    def __iter__(self):
        x, y = regression()
        return iter(zip(x, y))

    def __len__(self):
        return SAMPLES


def linear_reference(samples: int = SAMPLES) -> dict[str, torch.Tensor]:
    """Global batches of G in order; a short last one dropped (the stream's rule)."""
    x, y = regression(samples)
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for b in range(samples // G):
        opt.zero_grad()
        F.mse_loss(model(x[b * G : (b + 1) * G]), y[b * G : (b + 1) * G]).backward()
        opt.step()
    return model.state_dict()


def iterable(micro: int | None) -> tuple[phalanx.Session, dict]:
    session = _session(micro)
    model = linear()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = session.setup_loader(DataLoader(Stream(), batch_size=3), train=True)  # batches of 3, re-cut into G
    batches = 0
    for _ in session.epochs():
        for x, y in loader:
            batches += 1
            with session.accumulate(model):
                session.backward(F.mse_loss(model(x), y))
    return session, {
        "state": session.model_state_dict(),
        "steps": session.step_count,
        "batches": batches,
        "len": len(loader),
    }


def in_memory(micro: int | None) -> tuple[phalanx.Session, dict]:
    session = _session(micro)
    model = linear()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    x, y = session.shard(*regression(5 * G))  # this rank's share of each global batch
    mb = session.batch.micro_batch_size
    for _ in session.epochs():
        for k in range(len(x) // mb):
            with session.accumulate(model):
                session.backward(F.mse_loss(model(x[k * mb : (k + 1) * mb]), y[k * mb : (k + 1) * mb]))
    return session, {"state": session.model_state_dict(), "steps": session.step_count, "rows": len(x)}


SCENARIOS = {
    "lm_stream": lm_stream,
    "lm_ordered_loader": lm_ordered_loader,
    "iterable": iterable,
    "in_memory": in_memory,
}


def run_all(micro: int | None) -> dict[str, dict]:
    """Every scenario in this process (one process group for all; the first Session owns it)."""
    sessions, out = [], {}
    for name, scenario in SCENARIOS.items():
        session, result = scenario(micro)
        sessions.append(session)
        out[name] = {**result, "world": session.world_size, "accumulation": session.accumulation_steps}
    for session in reversed(sessions):
        session.close()
    return out
