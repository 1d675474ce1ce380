"""A word-level language model on one device, written the classic way: an LSTM trained with
truncated back-propagation through time on a token stream cut into columns, a hidden state carried
from batch to batch, a hand-written SGD update with gradient clipping, and the learning rate
divided by 4 whenever validation stops improving. The starting point of docs/porting.md: compare
with lm_phalanx.py, lm_accelerate.py and lm_fabric.py in this folder.

Ported to Lightning Fabric (run: fabric run --accelerator cpu --devices 2 lm_fabric.py), for the line
count in docs/porting.md."""

import argparse
import math

import torch
from lightning_fabric import Fabric
from torch import nn

from phalanx.demo.text import Corpus  # generated text: no download

parser = argparse.ArgumentParser(description="LSTM language model on a generated corpus")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=20.0)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--batch-size", type=int, default=20)
parser.add_argument("--bptt", type=int, default=35)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=1111)
parser.add_argument("--save", default="model.pt")
args = parser.parse_args()

fabric = Fabric()
torch.manual_seed(args.seed)
device = fabric.device
corpus = Corpus()


def batchify(data, bsz, shard=True):
    """Cut the stream into ``bsz`` columns: column j continues from batch to batch."""
    nbatch = data.size(0) // bsz
    columns = data[: nbatch * bsz].view(bsz, -1).t().contiguous()
    if shard:  # this process's own columns, so that its hidden state stays its own
        per = bsz // fabric.world_size
        columns = columns[:, fabric.global_rank * per : (fabric.global_rank + 1) * per]
    return columns.to(device)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp=64, nhid=64, nlayers=2, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nlayers, self.nhid = nlayers, nhid

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(input)), hidden)
        return self.decoder(self.drop(output)).view(-1, self.decoder.out_features), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    """Cut the graph between batches: back-propagation stops at the batch boundary."""
    return tuple(v.detach() for v in h)


train_data = batchify(corpus.train, args.batch_size)
val_data = batchify(corpus.valid, 10, shard=False)
test_data = batchify(corpus.test, 10, shard=False)
model = fabric.setup_module(RNNModel(corpus.vocab, dropout=args.dropout))
criterion = nn.CrossEntropyLoss()


def evaluate(data_source):
    model.eval()
    total_loss, hidden = 0.0, model.init_hidden(data_source.size(1))
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train(lr):
    model.train()
    hidden = model.init_hidden(train_data.size(1))
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        hidden = repackage_hidden(hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        fabric.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        if batch % 50 == 0:
            fabric.print(f"batch {batch} lr {lr:g} loss {loss.item():.3f}")


lr, best_val_loss = args.lr, None
for epoch in range(1, args.epochs + 1):
    train(lr)
    val_loss = evaluate(val_data)
    fabric.print(f"epoch {epoch} valid ppl {math.exp(val_loss):.2f}")
    if best_val_loss is None or val_loss < best_val_loss:
        fabric.save(args.save, {"model": model})
        best_val_loss = val_loss
    else:
        lr /= 4.0

fabric.load(args.save, {"model": model})
fabric.print(f"test ppl {math.exp(evaluate(test_data)):.2f} (the corpus's floor is {corpus.floor():.2f})")
