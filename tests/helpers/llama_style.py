"""A small model written the way Meta's llama/model.py is (plain nn.Linear where Meta has
fairscale's parallel layers): attention of wq, wk, wv, wo with n_heads and n_kv_heads (grouped
query attention), rotary embeddings, a SwiGLU FeedForward of w1, w2, w3, and an RMSNorm class of
its own. ``view`` picks how attention reshapes into heads: ``"-1"`` (what a split needs),
``"attribute"`` (Meta's ``view(bsz, seqlen, self.n_local_heads, self.head_dim)`` with the
model-parallel size 1: the whole model's count) or ``"args"`` (the whole count read from the
arguments, which reading the module's attributes cannot see). Also its training loop, plain and through a Session."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, PhalanxError, Session

GLOBAL_BATCH, STEPS, SEQ = 8, 3, 16
# Every module a split could take, sequence-parallel norms of the model's own RMSNorm class included.
FULL_PLAN = {
    "layers.*.attention.w[qkv]": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w[13]": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.*_norm": "sequence_parallel",
    "norm": "sequence_parallel",
}


@dataclasses.dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 64
    multiple_of: int = 16
    norm_eps: float = 1e-5
    max_seq_len: int = SEQ
    view: str = "-1"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq), torch.view_as_real(xk_ * freqs_cis).flatten(
        3
    ).type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        model_parallel_size = 1
        self.n_local_heads = args.n_heads // model_parallel_size
        self.n_local_kv_heads = self.n_kv_heads // model_parallel_size
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, -1, self.head_dim)
        xk = xk.view(bsz, seqlen, -1, self.head_dim)
        xv = xv.view(bsz, seqlen, -1, self.head_dim)
        return self.attend(xq, xk, xv, freqs_cis, mask)

    def attend(self, xq, xk, xv, freqs_cis, mask):
        bsz, seqlen = xq.shape[:2]
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class MetaAttention(Attention):
    """Meta's own reshape: the head count held, the whole model's where model_parallel_size is 1."""

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        return self.attend(xq, xk, xv, freqs_cis, mask)


class ArgsAttention(Attention):
    """The whole count read from the model's arguments: nothing in the module's own attributes."""

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.args.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.args.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.args.n_kv_heads, self.head_dim)
        return self.attend(xq, xk, xv, freqs_cis, mask)


ATTENTIONS = {"-1": Attention, "attribute": MetaAttention, "args": ArgsAttention}


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = ATTENTIONS[args.view](args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(TransformerBlock(params) for _ in range(params.n_layers))
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(params.dim // params.n_heads, params.max_seq_len * 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:seqlen].to(h.device)
        mask = torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=tokens.device), diagonal=1)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        return self.output(self.norm(h)).float()


# -- training ------------------------------------------------------------------------------------


def build(view: str = "-1") -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs(view=view))


def tokens() -> torch.Tensor:
    return torch.randint(
        0, ModelArgs.vocab_size, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1)
    )


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def reference() -> dict[str, torch.Tensor]:
    """A plain one-process SGD loop over the same global batches."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for batch in tokens().split(GLOBAL_BATCH):
        loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(strategy: str, tp: int | None, given: dict | None, view: str = "-1") -> dict:
    """One script for every strategy: only the config's strategy section changes. ``given``: the
    plan for session.set_tp_plan (None: the automatic plan). A refusal comes back as its line."""
    session = Session(
        Config(),
        strategy={"name": strategy, "tp": {"size": tp}},
        batch={"global_batch_size": GLOBAL_BATCH},
        train={"progress": False, "seed": 0, "metrics": False},
        checkpoint={"dir": "checkpoints", "resume": "never"},
    )
    try:
        if given is not None:
            session.set_tp_plan(given)
        model = build(view)
        model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        loader = session.setup_loader(DataLoader(TensorDataset(tokens()), batch_size=GLOBAL_BATCH), train=True)
        for _ in session.epochs():
            for (batch,) in loader:
                with session.accumulate(model):
                    session.backward(loss_of(model, batch))
    except PhalanxError as err:
        session.close()
        return {"refused": str(err)}
    plan = getattr(session.strategy, "tp_plan", None)
    out = {
        "state": {k: v.detach().cpu() for k, v in session.model_state_dict().items()},
        "steps": session.step_count,
        "describe": session.strategy.describe(),
        "split": sorted(plan.split()) if plan is not None else [],
    }
    session.close()
    return out


def run(args: tuple) -> dict:
    return train(*args)
