"""``session.load_weights``: pretrained weights read once and put where each rank holds them, and
the check that a deferred model's uninitialised modules get weights before they run.

Rank 0 reads the source one tensor at a time (checkpoint/weights.py: a safetensors file is read,
not memory-mapped; checkpoint/hf_files.py: a Hugging Face directory, an index or a list of files,
one shard open at a time, in the files' order) and broadcasts it; each rank copies its share in
(strategy.put_weight: the whole tensor, its FSDP shard, or nothing for another pipeline stage's
tensor). So the host memory of a load is about one tensor on each rank, however large the model,
and the device memory one full tensor on top of what the rank keeps. Every verdict (a file that cannot be read, keys or
shapes that do not match, a tied weight the source holds under two names with different values) is
decided on rank 0 and broadcast first, so all ranks raise the same one-line error, none is left
waiting in a broadcast, and a load refused by a verdict changes nothing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from phalanx.checkpoint.hf_files import open_weights
from phalanx.errors import PhalanxError
from phalanx.strategies import Strategy
from phalanx.strategies.construction import uninitialised_message
from phalanx.topology import Topology
from phalanx.util.words import plural

_SHOWN = 4  # keys named in a mismatch message, per kind


class Weights:
    """One per Session: loads weights into its models and guards their first forward."""

    def __init__(self, strategy: Strategy, topology: Topology, models: list[nn.Module]):
        self.strategy = strategy
        self.topology = topology
        self._models = models  # the Session's list: the models setup() returned
        self._roots: dict[int, nn.Module] = {}  # a returned model -> the user's model it was set up from
        self._loaded: dict[int, set[str]] = {}  # a returned model -> the names load() filled in it
        self._classes: dict[str, str] = {}  # module name -> class name, for the uninitialised line
        self._not_initialised: set[str] = set()  # modules built under init_module(initialize=False)

    def watch(self, wrapped: nn.Module, model: nn.Module) -> None:
        """After ``setup()`` of a deferred ``model``: its first forward is refused while modules
        that nothing initialised hold uninitialised weights that no load filled."""
        self._roots[id(wrapped)] = model
        if not self.strategy.uninitialised(model):
            return
        modules = {name or "(the model)": m for name, m in model.named_modules()}
        self._classes.update({name: type(m).__name__ for name, m in modules.items()})
        self._not_initialised.update(name for name, m in modules.items() if m in self.strategy.skip_init)
        handle = None

        def refuse(*_: Any) -> None:
            pending = self.pending(wrapped)
            if pending:
                skipped = any(name in self._not_initialised for name in pending)
                raise PhalanxError(uninitialised_message(pending, self._classes, skipped))
            handle.remove()

        handle = wrapped.register_forward_pre_hook(refuse)

    def filled(self) -> None:
        """Every set-up model's weights came from a checkpoint (a resume): none is uninitialised."""
        for wrapped in self._models:
            uninitialised = self.strategy.uninitialised(self._roots.get(id(wrapped), wrapped))
            self._loaded.setdefault(id(wrapped), set()).update(n for names in uninitialised.values() for n in names)

    def pending(self, wrapped: nn.Module) -> dict[str, list[str]]:
        """Modules of a returned model whose uninitialised tensors are not all loaded yet."""
        loaded = self._loaded.get(id(wrapped), set())
        uninitialised = self.strategy.uninitialised(self._roots.get(id(wrapped), wrapped))
        return {m: names for m, names in uninitialised.items() if not set(names) <= loaded}

    def load(self, model: nn.Module | None, source: Any, *, strict: bool = True) -> None:
        model = self._target(model)
        groups = _aliases(self.strategy.weight_slots(model))
        main, alone = self.topology.rank == 0, self.topology.world_size == 1
        reader, verdict, index = None, None, None
        if main:
            try:
                reader = _open(source)
                index = reader.index()
                name = _name(source)
                verdict = _mismatch(index, groups, strict, name) or _untied(reader, index, groups, name)
            except PhalanxError as err:
                verdict = str(err)
        if not alone:
            box = [verdict, index]
            dist.broadcast_object_list(box, src=0)
            verdict, index = box
        loaded = self._loaded.setdefault(id(model), set())
        try:
            if verdict:
                raise PhalanxError(verdict)
            for present, names, slot in _in_file_order(groups, index):
                self._transfer(present, slot, index[present], reader, alone)
                loaded.update(names)
        finally:
            if reader is not None:
                reader.close()

    def _target(self, model: nn.Module | None) -> nn.Module:
        if model is not None:
            if not any(model is m for m in self._models):
                raise PhalanxError(
                    "session.load_weights() takes a model that session.setup() returned; set the model up first"
                )
            return model
        if len(self._models) != 1:
            raise PhalanxError(
                "call session.load_weights(source) after session.setup(model)"
                if not self._models
                else "several models are set up: pass the one to load, session.load_weights(source, model)"
            )
        return self._models[0]

    def _transfer(self, name: str, slot: torch.Tensor, meta: tuple, reader: Any, alone: bool) -> None:
        shape, dtype = meta
        value, problem = None, None
        if self.topology.rank == 0:
            try:
                value = reader.read(name)
            except PhalanxError as err:
                problem = str(err)
        if not alone:
            value = self._broadcast(value, shape, dtype, problem)
        elif problem:
            raise PhalanxError(problem)
        if not slot.is_meta:
            self.strategy.put_weight(slot, value)

    def _broadcast(self, value: torch.Tensor | None, shape: tuple, dtype: torch.dtype, problem: str | None):
        """Rank 0's tensor on every rank, as bytes (gloo does not broadcast every dtype) with one
        status byte after them: a read that failed half-way (a file truncated since its index was
        read) is announced in the same broadcast, so no rank waits for a tensor that never comes."""
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = torch.empty(nbytes + 1, dtype=torch.uint8, device=self.topology.comm_device)
        if self.topology.rank == 0:
            if problem is None:
                buffer[:nbytes].copy_(value.reshape(-1).view(torch.uint8))
            buffer[nbytes] = 1 if problem else 0
        dist.broadcast(buffer, src=0)
        if buffer[nbytes].item():
            box = [problem]
            dist.broadcast_object_list(box, src=0)
            raise PhalanxError(box[0])
        return buffer[:nbytes].view(dtype).view(shape)


def _open(source: Any) -> Any:
    if isinstance(source, Mapping):
        return _StateDict(source)
    if isinstance(source, (str, Path)) or _paths(source):
        return open_weights(source)
    raise PhalanxError(
        "session.load_weights() takes a state dict or the path of a weights file (.safetensors, .pt), of a Hugging "
        f"Face model directory or of an index file (*.index.json), or a list of weight files, not {_what(source)}"
    )


def _paths(source: Any) -> bool:
    return isinstance(source, (list, tuple)) and all(isinstance(p, (str, Path)) for p in source)


def _what(source: Any) -> str:
    if isinstance(source, (list, tuple)):
        odd = next(p for p in source if not isinstance(p, (str, Path)))
        return f"a {type(source).__name__} holding {type(odd).__name__}"
    return type(source).__name__


def _name(source: Any) -> str:
    if isinstance(source, (str, Path)):
        return f"'{source}'"
    if _paths(source):
        return f"'{source[0]}'" if len(source) == 1 else f"the set of {len(source)} weight files ('{source[0]}', ...)"
    return "the state dict"


def _in_file_order(groups: list[tuple[list[str], torch.Tensor]], index: dict) -> list[tuple[str, list[str], Any]]:
    """(the name to read, every name of the tensor, its slot) for each tensor the source holds, in
    the source's order: a sharded source is then read shard after shard, each opened once. A tied
    weight is read once, under the first of its names the source has (_untied has made sure that
    its other names there hold the same values). Every rank computes the same order (the groups and
    the broadcast index are the same everywhere)."""
    position = {name: i for i, name in enumerate(index)}
    found = []
    for names, slot in groups:
        present = next((n for n in names if n in index), None)
        if present is not None:
            found.append((present, names, slot))
    return sorted(found, key=lambda item: position[item[0]])


class _StateDict:
    """A state dict given in memory, read as a file is (rank 0's is the one used)."""

    def __init__(self, state: Mapping):
        bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise PhalanxError(
                f"the state dict given to session.load_weights() maps {bad[0]!r} to "
                f"{type(state[bad[0]]).__name__}; give a mapping of parameter names to tensors"
            )
        self._state = state

    def index(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self._state.items()}

    def read(self, name: str) -> torch.Tensor:
        return self._state[name].detach().cpu()

    def close(self) -> None:
        pass


def _aliases(slots: dict[str, torch.Tensor]) -> list[tuple[list[str], torch.Tensor]]:
    """The state dict's names grouped by tensor: a tied weight (an embedding and the output layer
    that shares it) is one tensor under several names, of which a file may hold any one (Hugging
    Face files leave the output layer's out)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, slot in slots.items():
        # Also for another stage's placeholders, which keep its ties (Pipeline.weight_slots).
        groups.setdefault(id(slot), ([], slot))[0].append(name)
    return list(groups.values())


def _mismatch(index: dict, groups: list[tuple[list[str], torch.Tensor]], strict: bool, source: str) -> str | None:
    """What keeps ``index`` (name -> (shape, dtype)) from loading into ``groups`` (see _aliases);
    None when it loads."""
    problems = []
    present = [(n, slot) for names, slot in groups for n in names if n in index]
    if not present and index and groups:
        # strict=False would load nothing at all, silently: most often a name prefix that differs.
        return _no_common_name(list(index), [n for names, _ in groups for n in names], source)
    if strict:
        known = {n for names, _ in groups for n in names}
        missing = [names[0] for names, _ in groups if not any(n in index for n in names)]
        unexpected = [k for k in index if k not in known]
        if missing:
            problems.append(f"{plural(len(missing), 'key')} of the model missing ({_some(missing)})")
        if unexpected:
            problems.append(f"{plural(len(unexpected), 'key')} the model does not have ({_some(unexpected)})")
    shapes = [(k, slot) for k, slot in present if tuple(index[k][0]) != tuple(slot.shape)]
    if shapes:
        shown = "; ".join(
            f"{k} is {_shape(index[k][0])} in the file, {_shape(s.shape)} in the model" for k, s in shapes[:_SHOWN]
        )
        more = f" and {len(shapes) - _SHOWN} more" if len(shapes) > _SHOWN else ""
        problems.append(f"shapes differ: {shown}{more}")
    kinds = [(k, slot) for k, slot in present if _kind(index[k][1]) != _kind(slot.dtype)]
    if kinds:
        k, slot = kinds[0]
        problems.append(
            f"{plural(len(kinds), 'tensor')} of another kind ({k} is {index[k][1]} in the file, {slot.dtype} "
            "in the model)"
        )
    if not problems:
        return None
    fix = "load weights saved from this model" + (
        ", or pass strict=False to skip missing and unexpected keys" if strict and not (shapes or kinds) else ""
    )
    return f"{source} does not match the model: {'; '.join(problems)}; {fix}"


def _no_common_name(theirs: list[str], ours: list[str], source: str) -> str:
    """The line for a source that shares no tensor name with the model, with the prefix that tells
    them apart where there is one (a base model's weights for a model with a head, or the reverse)."""
    hint = ""
    for a, b, where in ((theirs, ours, "the model's names are its names with {!r} in front"),
                        (ours, theirs, "its names are the model's with {!r} in front")):  # fmt: skip
        longer = set(b)
        prefix = next((n[: -len(a[0])] for n in b if n.endswith("." + a[0])), None)
        if prefix and sum(prefix + n in longer for n in a) * 2 > len(a):
            hint = f" ({where.format(prefix)})"
            break
    return (
        f"{source} shares no tensor name with the model{hint or f' (it has {theirs[0]!r}, the model {ours[0]!r})'}, "
        "so nothing would load, strict or not; phalanx does not rename keys: rename them in a state dict and pass "
        "that, or load weights saved from this model's class"
    )


def _untied(reader: Any, index: dict, groups: list[tuple[list[str], torch.Tensor]], source: str) -> str | None:
    """The refusal when the source holds several names of one tied tensor with different values:
    the model holds one tensor, the load reads one of its names (see _in_file_order), and an untied
    checkpoint would otherwise lose the others' values without a word. Rank 0 reads the names one
    after the other (the first and one more at a time) before anything is loaded, so a refusal
    leaves the model as it was; the load then reads the first again, a cost paid only by a source
    that holds a tie twice (a torch.save of a tied model's state_dict())."""
    for names, slot in groups:
        present = [n for n in names if n in index]
        if len(present) < 2:
            continue
        first = reader.read(present[0]).to(slot.dtype)  # as the model would hold it (a no-op when the dtypes agree)
        for other in present[1:]:
            if not _same(first, reader.read(other).to(slot.dtype)):
                return (
                    f"{source} holds {present[0]} and {other} with different values, but the model ties them "
                    "(one tensor); build the model untied (for a Hugging Face model, tie_word_embeddings=False) "
                    "or load weights that hold only one of them"
                )
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.equal(a, b):
        return True
    # torch.equal is False for any NaN; the same NaN under both names is still one value. This
    # costs a mask of the tensor's size, only for tensors that torch.equal already found unequal.
    floating = a.is_floating_point() or a.is_complex()
    return floating and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:_SHOWN]) + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _shape(shape: Any) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def _kind(dtype: torch.dtype) -> str:
    # Floats load into floats of any width (weights are often shipped in bf16); integers and flags
    # into their own kind.
    if dtype.is_floating_point or dtype.is_complex:
        return "float"
    return "bool" if dtype == torch.bool else "int"
