"""Which modules tensor parallelism splits, and how: the plan ``parallelize_module`` applies.

The plan comes from, in this order: the user (``strategy.tp.plan``: module-name glob patterns to
style names, or DTensor ``ParallelStyle`` objects given in Python); a Hugging Face model's own
``base_model_tp_plan``; else an automatic plan of what can be split without the model's
cooperation, the ``nn.Linear`` pairs of MLP blocks (up and gate colwise, down rowwise). Attention
is never split automatically: a module that reshapes its projections into a head count it holds
(``view(b, s, self.num_heads, d)``) breaks when a peer holds a fraction of the heads; only the
model can say that it reshapes with ``-1`` (Hugging Face's plans do). Every module a plan names is
checked here, before anything is split: a pattern that matches nothing, a style the module cannot
take, a size the peers would split unevenly, each is one line naming the module and the fix.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from phalanx.errors import ConfigError
from phalanx.strategies import tp_heads
from phalanx.strategies.sequence_norms import is_norm
from phalanx.strategies.tp_auto import automatic
from phalanx.util.modules import parameter_holders

# Names of the styles a config may give; their DTensor styles are made in styles().
STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate")
# Hugging Face's style names that mean one of phalanx's (the rest of theirs need their own hooks).
_HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "sequence_parallel": "sequence_parallel"}
_OWN = "'s own tp_plan"  # the end of a model's own plan's source, "LlamaForCausalLM's own tp_plan"
# The size a style cuts, per module kind: (attribute, what it counts).
_SPLIT_SIZES = {
    (nn.Linear, "colwise"): ("out_features", "output features"),
    (nn.Linear, "rowwise"): ("in_features", "input features"),
    (nn.Embedding, "colwise"): ("embedding_dim", "embedding width"),
    (nn.Embedding, "rowwise"): ("num_embeddings", "vocabulary rows"),
}


@dataclass(frozen=True)
class TPPlan:
    """``styles``: module name -> style name or ParallelStyle; ``source``: where it came from;
    ``kept_whole``: attention-like modules the automatic plan leaves on every peer, whole."""

    styles: dict[str, Any]
    source: str
    kept_whole: tuple[str, ...] = ()
    # MLP-shaped blocks the automatic plan leaves whole: their step between up and down mixes units.
    mixing: tuple[str, ...] = ()

    def split(self) -> dict[str, Any]:
        """The modules actually split (``replicate`` keeps a module whole)."""
        return {name: style for name, style in self.styles.items() if style != "replicate"}

    def describe(self) -> str:
        return f"{len(self.split())} modules split ({self.source})"


def resolve(model: nn.Module, tp: int, configured: Mapping[str, str], given: Mapping[str, Any] | None = None) -> TPPlan:
    """The plan for ``model`` at ``tp`` peers: ``given`` (Python, ParallelStyle values allowed) or
    ``configured`` (strategy.tp.plan) first, then the model's own, then the automatic one."""
    modules = dict(model.named_modules())
    if given or configured:
        source = "the plan given to setup()" if given else "strategy.tp.plan"
        styles = _expand(dict(given or configured), modules, source)
        plan = TPPlan(styles, source)
    else:
        plan = _huggingface(model, modules)
        if plan is None:
            styles, whole, mixing = automatic(model, modules)
            plan = TPPlan(styles, "automatic: MLP blocks", whole, mixing)
    for name, style in plan.styles.items():
        _check(name, modules[name], style, tp, plan.source)
    tp_heads.check(model, plan.split(), tp, plan.source)
    _check_ties(model, plan)
    return plan


def _check_ties(model: nn.Module, plan: TPPlan) -> None:
    """A split module's weight held by a module outside it as well (an embedding tied to the
    output layer) would be split in one holder and stay whole in the other: untied, silently."""
    modules, holders = dict(model.named_modules()), parameter_holders(model)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    for name in plan.split():
        inside = {id(m) for m in modules[name].modules()}
        for own, param in modules[name].named_parameters(recurse=False):
            other = next((m for m, _ in holders.get(id(param), []) if id(m) not in inside), None)
            if other is not None:
                raise ConfigError(
                    f"{plan.source}: module '{name}' shares its {own} with '{names.get(id(other), '?')}' "
                    "(a tied weight), "
                    "which a split of one holder would untie; leave it out of the plan (or 'replicate'), "
                    "or untie the weights"
                )


def _expand(patterns: dict[str, Any], modules: dict[str, nn.Module], source: str) -> dict[str, Any]:
    """Patterns -> module names. Later patterns win where two match one module, as in a dict."""
    styles: dict[str, Any] = {}
    for pattern, style in patterns.items():
        if isinstance(style, str) and style not in STYLES:
            raise ConfigError(f"{source}: '{pattern}: {style}' is no style; use one of {', '.join(STYLES)}")
        matched = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            near = sorted(name for name in modules if name and name.rsplit(".", 1)[-1] == pattern.rsplit(".", 1)[-1])
            hint = f" (modules of that name: {', '.join(near[:3])})" if near else ""
            raise ConfigError(
                f"{source}: pattern '{pattern}' matches no module of the model{hint}; patterns match the names "
                "of model.named_modules(), e.g. 'layers.*.mlp.up'"
            )
        for name in matched:
            styles[name] = style
    return styles


def _huggingface(model: nn.Module, modules: dict[str, nn.Module]) -> TPPlan | None:
    """The model's own plan: ``config.base_model_tp_plan``, relative to its base model."""
    config = getattr(model, "config", None)
    own = getattr(config, "base_model_tp_plan", None)
    if not own or not isinstance(own, Mapping):
        return None
    base = next((name for name, module in modules.items() if module is getattr(model, "base_model", None)), "")
    prefix = f"{base}." if base else ""
    patterns = {}
    for pattern, style in own.items():
        if style not in _HF_STYLES:
            raise ConfigError(
                f"the model's own tp_plan gives '{pattern}: {style}', a Hugging Face style phalanx does not apply; "
                "set strategy.tp.plan to the modules to split (colwise, rowwise, sequence_parallel, replicate)"
            )
        patterns[prefix + pattern] = _HF_STYLES[style]
    source = f"{type(model).__name__}{_OWN}"
    return TPPlan(_expand(patterns, modules, source), source)


def _check(name: str, module: nn.Module, style: Any, tp: int, source: str) -> None:
    if not isinstance(style, str):
        return  # a ParallelStyle given in Python: the user's own, checked by DTensor itself
    where = f"{source}: module '{name}' ({type(module).__name__})"
    if style in ("colwise", "rowwise"):
        kind = next((k for k in (nn.Linear, nn.Embedding) if isinstance(module, k)), None)
        if kind is None:
            raise ConfigError(f"{where} cannot be split {style}: only nn.Linear and nn.Embedding can; name those")
        attribute, what = _SPLIT_SIZES[kind, style]
        size = getattr(module, attribute)
        if size % tp:
            raise ConfigError(
                f"{where} has {size} {what}, which {tp} tensor-parallel peers would split unevenly; "
                f"set strategy.tp.size to a divisor of {size}, or leave the module out of the plan"
            )
    elif style == "sequence_parallel" and not is_norm(module):
        raise ConfigError(
            f"{where} cannot take sequence_parallel: only a norm over the last dimension can (nn.LayerNorm, "
            "nn.RMSNorm, or a class whose name ends in Norm with 1-d parameters only, such as a model's own RMSNorm)"
        )


def kept_whole_line(model: nn.Module, plan: TPPlan) -> str | None:
    """The line the Session prints when the automatic plan leaves attention whole."""
    if not plan.kept_whole:
        return None
    first = plan.kept_whole[0]
    module = dict(model.named_modules())[first]
    more = f" and {len(plan.kept_whole) - 1} more" if len(plan.kept_whole) > 1 else ""
    head = f"phalanx: tp keeps attention '{first}'{more} whole on every peer"
    if isinstance(module, nn.MultiheadAttention):
        return (
            f"{head}: nn.MultiheadAttention packs q, k and v into one weight, which no plan can split by heads; "
            "an attention of its own q, k, v and output nn.Linear layers that reshapes with -1 heads can be split"
        )
    linears = [n for n, c in module.named_children() if isinstance(c, nn.Linear)]
    pattern = _pattern_of(first)
    lines = ", ".join(
        f"'{pattern}.{n}': {'rowwise' if i == len(linears) - 1 else 'colwise'}" for i, n in enumerate(linears)
    )
    return (
        f"{head}: a module that reshapes into the head count it holds cannot run on a fraction of the heads; "
        f"if its forward reshapes with the local count (n_heads // tp_size, or -1), split it with strategy.tp.plan "
        f"{{{lines}}}"
    )


def split(
    model: nn.Module, mesh: Any, configured: Mapping[str, str], given: Mapping[str, Any] | None, *, main: bool
) -> TPPlan:
    """Resolve the plan over ``mesh`` (the tensor axis), say on the ``main`` rank what it keeps
    whole, and apply it; returns the plan."""
    plan = resolve(model, mesh.size(), configured, given)
    if main:
        mixing = (
            f"phalanx: tp keeps '{plan.mixing[0]}'"
            + (f" and {len(plan.mixing) - 1} more" if len(plan.mixing) > 1 else "")
            + " whole on every peer: the step between its up and down layers mixes the hidden units (a softmax "
            "or a norm over them), which a peer holding a slice of them cannot compute"
            if plan.mixing
            else None
        )
        for line in (kept_whole_line(model, plan), mixing, *unpaired_lines(model, plan, mesh.size())):
            if line:
                print(line, flush=True)
    apply(model, mesh, plan)
    tp_heads.guard_forwards(model, plan.split(), mesh.size(), plan.source)
    return plan


def unpaired_lines(model: nn.Module, plan: TPPlan, tp: int) -> list[str]:
    """One line per Linear a user's plan splits colwise with no rowwise Linear in the plan that
    takes its output features: its output stays one slice per peer, which a loss reading whole
    logits fails on but an argmax or a metric reads silently wrong. (A model's own plan is its
    author's: attention's key and value projections feed the attention, not a rowwise layer.)"""
    if plan.source.endswith(_OWN):
        return []
    modules = dict(model.named_modules())
    rowwise = [n for n, s in plan.styles.items() if s == "rowwise" and type(modules[n]) is nn.Linear]
    taken = {modules[n].in_features for n in rowwise}
    # An attention's key and value projections feed the attention, whose output its own rowwise layer takes.
    parents = {n.rpartition(".")[0] for n in rowwise}
    return [
        f"phalanx: tp splits '{name}' colwise, and no rowwise layer of the plan takes its {modules[name].out_features} "
        f"features: its output stays 1/{tp} of them on each peer; if the model reads it whole, give that module "
        "ColwiseParallel(output_layouts=Replicate()) with session.set_tp_plan(), or leave it out of the plan"
        for name, style in plan.styles.items()
        if style == "colwise"
        and type(modules[name]) is nn.Linear
        and modules[name].out_features not in taken
        and name.rpartition(".")[0] not in parents
    ]


def apply(model: nn.Module, mesh: Any, plan: TPPlan) -> None:
    """Split ``model`` in place over ``mesh`` (the tensor-parallel axis) as ``plan`` says.

    The strings' styles take and give whole (replicated) local tensors, so a module the plan names
    fits between modules it does not: colwise gives its output's shard to the rowwise that follows,
    and a sequence_parallel norm takes the whole sequence, computes on its peer's slice of it and
    gives the whole sequence back (one all-gather). An embedding takes whole token ids and gives
    whole vectors, as the modules after it expect, whichever way its table is split."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    made = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    # DTensor's defaults are a Linear's (rowwise: input sharded on its last dimension; colwise: the
    # output left sharded for the rowwise after it); token ids are whole, and so must the vectors be.
    embedding = {
        "colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    modules = dict(model.named_modules())
    around = PrepareModuleInputOutput(
        input_layouts=(Replicate(),),
        desired_input_layouts=(Shard(1),),
        output_layouts=(Shard(1),),
        desired_output_layouts=(Replicate(),),
        use_local_input=False,
        use_local_output=True,
    )
    for name, style in plan.split().items():
        if style == "sequence_parallel":
            # Its hooks first: the slice reaches SequenceParallel as a DTensor, which it keeps.
            parallelize_module(model, mesh, {name: around})
            parallelize_module(model, mesh, {name: SequenceParallel(use_local_output=False)})
        elif isinstance(style, str):
            styles = embedding if isinstance(modules[name], nn.Embedding) else made
            parallelize_module(model, mesh, {name: styles[style]()})
        else:
            parallelize_module(model, mesh, {name: style})


def split_parameters(model: nn.Module, plan: TPPlan) -> int:
    """Parameters the plan divides among the peers (what ``phalanx plan`` divides by tp): colwise
    splits a layer's weight and bias, rowwise its weight (the bias is added once, whole)."""
    modules = dict(model.named_modules())
    total = 0
    for name, style in plan.split().items():
        if style in ("colwise", "rowwise") or not isinstance(style, str):
            own = dict(modules[name].named_parameters(recurse=False))
            total += sum(p.numel() for n, p in own.items() if style != "rowwise" or n == "weight")
    return total


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _pattern_of(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))
