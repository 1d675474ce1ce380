"""Deferred construction: a model built without its weights, materialised where each rank holds it.

Under :func:`empty_parameters` (``session.init_module()``) every parameter a module registers goes
to the meta device, which allocates nothing; buffers stay as the module built them (on the CPU),
so tables computed in ``__init__`` (rotary frequencies, masks) survive. ``setup()`` then hands the
model to the strategy, which calls :meth:`Materializer.materialize` on the part its rank holds:
the whole model (ddp, zero1, single, dp), one FSDP unit at a time just before it is sharded, one
pipeline stage, or each model-parallel unit on its own device.

A materialised module is initialised by its own ``reset_parameters()`` under a seed drawn from
``train.seed`` and the module's name in the model. The weights therefore do not depend on how the
model is split or on the number of processes (a 2-process fsdp run starts from exactly the
weights of a 1-process run), but they are not those an eager ``build()`` under
``torch.manual_seed`` gives. A module that holds parameters and has no ``reset_parameters()`` is
left uninitialised and recorded, so the Session can refuse to train it until weights are loaded.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib
from typing import Iterator

import torch
from torch import nn

from phalanx._torch_compat import module_initializer
from phalanx.errors import PhalanxError
from phalanx.util.modules import post_order


@contextlib.contextmanager
def empty_parameters(uninitialised: weakref.WeakSet | None = None) -> Iterator[None]:
    """Every parameter registered inside the block is put on the meta device (not thread-safe:
    it swaps ``nn.Module.register_parameter`` for the block, as a device context cannot keep buffers
    real). Modules that register one are added to ``uninitialised`` when given: their weights are
    to be loaded, so materialising them skips their initialisation."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if uninitialised is not None:
            uninitialised.add(module)
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise PhalanxError(
                f"{type(module).__name__} is a lazy module (its shapes come from the first batch), which cannot be "
                "built under session.init_module(); give it its input size, or build the model outside the block"
            )
        if param is not None and not param.is_meta:
            # The tensor was allocated but never written (torch.empty) or is a small init value:
            # its pages go back at once, and the module's own init ran on meta (a no-op).
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__class__ = type(param)  # a Parameter subclass stays one, with its attributes
            meta.__dict__.update(param.__dict__)
            param = meta
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def is_deferred(model: nn.Module) -> bool:
    """Whether any of the model's parameters or buffers is still on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def materialized_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers that exist (are not on the meta device)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        if not tensor.is_meta and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


class Materializer:
    """Materialises the meta parts of one model, naming modules as the whole model does."""

    def __init__(self, model: nn.Module, seed: int, *, in_place: bool = True, skip_init: weakref.WeakSet | None = None):
        self.root = model
        self.seed = seed
        self.skip_init = skip_init if skip_init is not None else weakref.WeakSet()
        # in_place: a materialised tensor keeps its Python object, so an optimizer built on the meta
        # parameters holds the real ones. False (fsdp): the module gets a new tensor and the meta one
        # stays empty, since the optimizer would otherwise keep every whole unit alive after its
        # sharding, until the optimizer is rebuilt (fsdp remaps it by parameter names).
        self.in_place = in_place
        # A meta tensor's replacement, for weights tied within a unit: weakly held, as a replacement
        # lives only until fsdp shards it; the meta tensor is kept, so its id is not reused.
        self._replaced: dict[int, tuple[torch.Tensor, weakref.ref]] = {}
        self.names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        # Modules left uninitialised (no reset_parameters): module name -> its tensors' names.
        self.uninitialised: dict[str, list[str]] = {}
        self._done: set[int] = set()

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """Give every still-meta tensor of ``module`` and its submodules memory on ``device`` and
        initialise it; tensors that exist already are moved there."""
        # One fork for the whole pass, over every GPU (a module's seed reaches all of them), so the
        # training's own generators are as they were before set-up.
        devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for sub in post_order(module):  # children first, so a parent's init sees initialised children
                self.materialize_own(sub, device)

    def materialize_own(self, module: nn.Module, device: torch.device) -> None:
        """The same for ``module``'s own tensors only; a module is handled once (a unit sharded
        since is not touched again when its parent is materialised)."""
        if id(module) not in self._done:
            self._done.add(id(module))
            self._one(module, device)

    def _one(self, module: nn.Module, device: torch.device) -> None:
        empty = []  # this module's tensors that get memory here, and so need initial values
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            tied = self._replaced.get(id(tensor), (None, lambda: None))[1]()
            if tied is not None:  # a weight tied to one materialised (and initialised) already
                setattr(module, name, tied)
            elif not tensor.is_meta:
                if tensor.device != device:  # built for real: moved as .to() moves it, same object
                    with torch.no_grad():
                        tensor.data = tensor.data.to(device)
            else:
                empty.append(name)
                new = _on(tensor, device)
                if self.in_place:
                    _swap(tensor, new, self.names.get(id(module), ""), name)  # keeps the Python object
                else:
                    self._replaced[id(tensor)] = (tensor, weakref.ref(new))
                    setattr(module, name, new)
        if not empty:
            return
        init = None if module in self.skip_init else module_initializer(module)
        name = self.names.get(id(module), "")
        if init is None:
            self.uninitialised[name or "(the model)"] = [f"{name}.{n}" if name else n for n in empty]
            return
        torch.manual_seed(self._seed_of(name))
        init()

    def _seed_of(self, name: str) -> int:
        # A stable hash (not Python's, which is salted per process) of the module's name.
        return (self.seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Memory on ``device`` for the meta ``tensor``, of its class and with its attributes (a
    Parameter subclass, flags set on a parameter in ``__init__``)."""
    new = torch.empty_like(tensor, device=device)
    if isinstance(tensor, nn.Parameter):
        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
        new.__class__ = type(tensor)
    new.__dict__.update(tensor.__dict__)
    return new


def _swap(tensor: torch.Tensor, new: torch.Tensor, module: str, name: str) -> None:
    try:
        torch.utils.swap_tensors(tensor, new)
    except RuntimeError as err:  # a weak reference to the tensor, say: torch cannot swap it
        where = f"{module}.{name}" if module else name
        raise PhalanxError(
            f"cannot materialise {where} built under session.init_module() ({str(err).splitlines()[0]}); "
            "build the model outside init_module(), or drop what holds on to the parameter"
        ) from None


def uninitialised_message(modules: dict[str, list[str]], classes: dict[str, str], skipped: bool) -> str:
    """The one line for modules that hold uninitialised parameters (``classes``: name -> class;
    ``skipped``: they were built under init_module(initialize=False))."""
    kinds = sorted({classes.get(name, "?") for name in modules})
    shown = ", ".join(list(modules)[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
    if skipped:
        return (
            f"the model was built under session.init_module(initialize=False), and the weights of {', '.join(kinds)} "
            f"({shown}) were not loaded; load them with session.load_weights(...) before the first forward, "
            "or build the model with initialize=True"
        )
    return (
        f"the model was built under session.init_module(), but {', '.join(kinds)} ({shown}) hold parameters and "
        "have no reset_parameters(), so their weights were never initialised; give the class a reset_parameters() "
        "that initialises its own parameters, or load weights with session.load_weights(...) before the first forward"
    )
