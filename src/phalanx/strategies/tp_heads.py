"""Attention a plan splits by heads: each peer holds ``heads / tp`` of them, so the head counts must
divide, and the forward must reshape into the count a peer holds (``-1``, or ``n_heads // tp``).

A forward that reshapes with the whole model's count (Meta's Llama: ``view(bsz, seqlen,
self.n_local_heads, self.head_dim)`` with ``n_local_heads = n_heads`` once its model-parallel size
is 1) fails inside torch at the first step (``shape '[8, 32, 4, 16]' is invalid``). Two checks say
so in one line instead: before the split, the forward's source is read for a head count of the
module (an int attribute named like ``n_heads``) in a shape (a ``view``/``reshape``/``unflatten``
argument, or a tuple), whose value times the module's ``head_dim`` is a split layer's whole width;
and, for what the source cannot show (a count read from elsewhere, no ``head_dim`` to compare
with), the first forward of each such module is run once beforehand without gradients, and
torch's shape error there becomes that line. Reading the source refuses before set-up ends; the
dry run is the net for the rest, at the cost of one attention forward per module, once.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from typing import Any

import torch
from torch import nn

from phalanx.errors import ConfigError, PhalanxError

# An attribute holding a head count: n_heads, n_local_kv_heads, num_key_value_heads, n_head, ...
HEAD_COUNT = re.compile(r"^(n|num)_?(local_)?(kv_|key_value_|attention_|q_)?heads?$")
_HEAD_DIM = ("head_dim", "head_size", "attention_head_size", "d_head", "dim_head")
_SHAPING = ("view", "reshape", "unflatten", "rearrange")
# torch's words for a view into a shape the tensor's size does not fill.
_SHAPE_ERROR = re.compile(r"shape '\[[\d, -]*\]' is invalid for input of size \d+")


def head_counts(module: nn.Module) -> dict[str, int]:
    """The module's own int attributes named like head counts."""
    return {k: v for k, v in vars(module).items() if HEAD_COUNT.match(k) and type(v) is int}


def split_by_heads(model: nn.Module, styles: dict[str, Any]) -> dict[str, list[nn.Linear]]:
    """Modules holding a head count whose ``nn.Linear`` children the plan splits colwise, with those."""
    modules = dict(model.named_modules())
    out: dict[str, list[nn.Linear]] = {}
    for name, style in styles.items():
        parent = name.rpartition(".")[0]
        child = modules[name]
        colwise = style == "colwise" or type(style).__name__.startswith("Colwise")
        if colwise and isinstance(child, nn.Linear) and head_counts(modules[parent]):
            out.setdefault(parent, []).append(child)
    return out


def check(model: nn.Module, styles: dict[str, Any], tp: int, source: str) -> None:
    """Refuse, in one line, head counts the peers would split unevenly, and a forward that reshapes
    with the whole model's head count."""
    _check_config_heads(model, styles, tp)
    modules = dict(model.named_modules())
    for name, linears in split_by_heads(model, styles).items():
        module = modules[name]
        where = f"{source} splits '{name}' ({type(module).__name__}) by heads over {tp} peers"
        for attr, count in head_counts(module).items():
            if count % tp:
                raise ConfigError(
                    f"{where}, and its {attr} = {count} does not divide by {tp}; set strategy.tp.size to a divisor "
                    f"of {count}, or leave its layers out of the plan"
                )
        head_dim = next((getattr(module, a) for a in _HEAD_DIM if type(getattr(module, a, None)) is int), None)
        widths = {lin.out_features for lin in linears}
        for attr in _shaping_counts(type(module)):
            count = getattr(module, attr, None)
            if type(count) is int and head_dim is not None and count * head_dim in widths:
                raise ConfigError(whole_count_line(where, f"self.{attr} = {count}, the whole model's head count", tp))


def whole_count_line(where: str, what: str, tp: int) -> str:
    return (
        f"{where}, but its forward reshapes with {what}, where a peer holds 1/{tp} "
        "of the heads; reshape with the local count (n_heads // tp_size, as strategy.tp.size says) or -1, "
        "e.g. view(bsz, seqlen, -1, self.head_dim)"
    )


@functools.lru_cache(maxsize=None)
def _shaping_counts(cls: type) -> tuple[str, ...]:
    """Head-count attribute names ``cls.forward`` puts in a shape; nothing where its source cannot be read."""
    forward = cls.__dict__.get("forward") or next(
        (k.__dict__["forward"] for k in cls.__mro__ if "forward" in k.__dict__), None
    )
    if forward is None or getattr(forward, "__module__", "").startswith("torch."):
        return ()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return ()
    shapes: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called(node) in _SHAPING:
            shapes.extend([*node.args, *(k.value for k in node.keywords)])
        elif isinstance(node, (ast.Tuple, ast.List)):
            shapes.append(node)
    # In the source's order (a set's would follow the string hash, which differs between processes):
    # the line names the same attribute on every run.
    names = (
        sub.attr
        for shape in shapes
        for sub in ast.walk(shape)
        if isinstance(sub, ast.Attribute)
        and isinstance(sub.value, ast.Name)
        and sub.value.id == "self"
        and HEAD_COUNT.match(sub.attr)
    )
    return tuple(dict.fromkeys(names))


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def guard_forwards(model: nn.Module, styles: dict[str, Any], tp: int, source: str) -> None:
    """For what the source check cannot see: each module split by heads runs its first forward once
    more beforehand, without gradients, on the same inputs and random state (every peer does, so
    the split layers' collectives pair up), and torch's shape error there becomes the one line
    that names the fix. Any other error is left to the real forward, which raises it as it is."""
    modules = dict(model.named_modules())
    for name in split_by_heads(model, styles):
        module = modules[name]
        where = f"{source} splits '{name}' ({type(module).__name__}) by heads over {tp} peers"
        guard = _DryRun(where, tp)
        guard.handle = module.register_forward_pre_hook(guard, with_kwargs=True)


class _DryRun:
    def __init__(self, where: str, tp: int):
        self.where, self.tp, self.handle = where, tp, None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.handle.remove()  # once, and not again inside the run below
        devices = [d.index for d in {p.device for p in module.parameters()} if d.type == "cuda"]
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                module(*args, **kwargs)
        except RuntimeError as err:
            found = _SHAPE_ERROR.search(str(err))
            if found is not None:
                what = f"the whole model's head count ({found.group()})"
                raise PhalanxError(whole_count_line(self.where, what, self.tp)) from None


def _check_config_heads(model: nn.Module, styles: dict[str, Any], tp: int) -> None:
    """A Hugging Face attention split colwise holds a fraction of the heads: they must divide."""
    config = getattr(model, "config", None)
    # Hugging Face names attention "self_attn", "attn" or "attention" (BERT, GPT-NeoX).
    split = [name for name, style in styles.items() if style != "replicate"]
    if not any(word in name for name in split for word in ("attn", "attention")):
        return
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(
                f"the model has {heads} {attr.replace('_', ' ')}, which {tp} tensor-parallel peers would split "
                f"unevenly; set strategy.tp.size to a divisor of {heads}"
            )
