"""The automatic tensor-parallel plan: what can be split without the model's cooperation.

That is the ``nn.Linear`` pairs of MLP blocks (up and gate colwise, down rowwise), where each
hidden unit goes from the up layers to the down layer on its own, which a small probe checks on
the real weights. Attention is never split here: a module that reshapes its projections into a head
count it holds (``view(b, s, self.num_heads, d)``) breaks when a peer holds a fraction of the
heads, and only the model can say it reshapes with ``-1`` (Hugging Face's plans do).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.strategies.tp_heads import head_counts


def automatic(
    model: nn.Module, modules: dict[str, nn.Module]
) -> tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]:
    """The styles of the MLP blocks' pairs (up and gate colwise, down rowwise); the attention
    modules kept whole; and the MLP-shaped blocks kept whole because their hidden units mix."""
    styles: dict[str, str] = {}
    whole = []
    mixing = []
    for name, module in modules.items():
        pair = _mlp_pair(module)
        if pair is not None and not _elementwise_between(module, *pair):
            mixing.append(name)
        elif pair is not None:
            ups, down = pair
            styles.update({_join(name, up): "colwise" for up in ups})
            styles[_join(name, down)] = "rowwise"
        elif _attention_like(module):
            whole.append(name)
    if not styles:
        mixed = f" ('{mixing[0]}' mixes its hidden units between them)" if mixing else ""
        raise ConfigError(
            f"tensor parallelism found nothing in {type(model).__name__} it can split by itself (the MLP blocks' "
            f"pairs of nn.Linear layers, up then down, with an elementwise step between){mixed}; name the modules to "
            "split in strategy.tp.plan, e.g. {'layers.*.mlp.up': colwise, 'layers.*.mlp.down': rowwise}"
        )
    return styles, tuple(whole), tuple(mixing)


def _elementwise_between(module: nn.Module, ups: list[str], down: str) -> bool:
    """Whether each hidden unit reaches ``down`` on its own: what a peer holding a slice of them
    needs. Probed on a small input (in eval mode, without gradients): a change of one unit of each
    up layer's output must change that unit of down's input and no other. A softmax or a norm over
    the hidden units fails; so does a forward the probe cannot run. A model on the meta device (the
    planner's) cannot run: its structure is taken as it is."""
    first = next(module.parameters())
    if first.is_meta:
        return True
    layers = dict(module.named_children())
    width, unit = layers[down].out_features, layers[down].in_features // 2
    seen: list[torch.Tensor] = []
    probe = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(0)).to(first.device, first.dtype)
    grab = layers[down].register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            module(probe)
            for up in ups:
                nudge = layers[up].register_forward_hook(_nudge(unit))
                try:
                    module(probe)
                finally:
                    nudge.remove()
    except Exception:  # noqa: BLE001 - any failure means the probe cannot vouch for the block
        return False
    finally:
        grab.remove()
        module.train(was_training)
    base = seen[0]
    for after in seen[1:]:
        moved = (after - base).abs().reshape(-1, base.shape[-1]).sum(0) > 0
        if moved.nonzero().flatten().tolist() != [unit]:
            return False
    return True


def _nudge(unit: int):
    """A forward hook that adds 10 to one hidden unit of a layer's output."""

    def hook(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        bump = torch.zeros(out.shape[-1], dtype=out.dtype, device=out.device)
        bump[unit] = 10.0
        return out + bump

    return hook


def _mlp_pair(module: nn.Module) -> tuple[list[str], str] | None:
    """``module``'s children as an MLP block: one or two Linear d->h (up, gate) and one Linear
    h->d (down), h != d, and no other child with parameters of its own. Of two, the later is down
    (either fits by shape); of three, the one the shapes single out, wherever it stands: Meta's
    Llama defines w1 (gate), w2 (down), then w3 (up)."""
    children = list(module.named_children())
    linears = [(n, c) for n, c in children if type(c) is nn.Linear]
    others = [c for _, c in children if type(c) is not nn.Linear and any(True for _ in c.parameters())]
    if others or not 2 <= len(linears) <= 3:
        return None
    for down_name, down in reversed(linears):
        dim, hidden = down.out_features, down.in_features
        ups = [(n, u) for n, u in linears if u is not down]
        if hidden != dim and all(u.in_features == dim and u.out_features == hidden for _, u in ups):
            return [n for n, _ in ups], down_name
    return None


def _attention_like(module: nn.Module) -> bool:
    """nn.MultiheadAttention, or a module of nn.Linear layers that holds a head count (n_heads,
    num_heads, n_local_heads, ...: tp_heads.HEAD_COUNT) or is named for attention."""
    if isinstance(module, nn.MultiheadAttention):
        return True
    named = any(word in type(module).__name__.lower() for word in ("attention", "attn"))
    return (named or bool(head_counts(module))) and any(isinstance(c, nn.Linear) for c in module.children())


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child
