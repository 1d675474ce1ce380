"""A word-level language model on one device, written the classic way: an LSTM trained with
truncated back-propagation through time on a token stream cut into columns, a hidden state carried
from batch to batch, a hand-written SGD update with gradient clipping, and the learning rate
divided by 4 whenever validation stops improving. The starting point of docs/porting.md: compare
with lm_phalanx.py, lm_accelerate.py and lm_fabric.py in this folder.

Ported to phalanx (run: phalanx launch lm_phalanx.py); docs/porting.md explains each changed line."""

import argparse
import math

import torch
from torch import nn

import phalanx
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

torch.manual_seed(args.seed)
session = phalanx.Session(batch={"global_batch_size": args.batch_size, "fixed_layout": True}, train={"seed": args.seed})
device = session.device
corpus = Corpus()


def batchify(data, bsz):
    """Cut the stream into ``bsz`` columns: column j continues from batch to batch."""
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous().to(device)


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


train_data = session.shard(batchify(corpus.train, args.batch_size), dim=1)  # this process's columns
val_data = batchify(corpus.valid, 10)
test_data = batchify(corpus.test, 10)
model = session.setup(RNNModel(corpus.vocab, dropout=args.dropout))
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
        if session.should_stop:  # train.max_steps, which phalanx bench and tune set
            break
        data, targets = get_batch(train_data, i)
        hidden = repackage_hidden(hidden)
        with session.accumulate(model):  # one optimizer step: its end zeroes the gradients and counts it
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            session.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
        if batch % 50 == 0:
            session.print(f"batch {batch} lr {lr:g} loss {loss.item():.3f}")


lr, best_val_loss = args.lr, None
for epoch in range(1, args.epochs + 1):
    train(lr)
    val_loss = evaluate(val_data)
    session.print(f"epoch {epoch} valid ppl {math.exp(val_loss):.2f}")
    if best_val_loss is None or val_loss < best_val_loss:
        if session.is_main:
            torch.save(model.state_dict(), args.save)
        session.barrier()
        best_val_loss = val_loss
    else:
        lr /= 4.0

model.load_state_dict(torch.load(args.save, weights_only=True))
session.print(f"test ppl {math.exp(evaluate(test_data)):.2f} (the corpus's floor is {corpus.floor():.2f})")
