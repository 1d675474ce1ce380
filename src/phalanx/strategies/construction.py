"""Deferred construction: a model built without its weights, materialised where each rank holds it.

Under :func:`empty_parameters` (``session.init_module()``) every parameter a module registers goes
to the meta device, which allocates nothing; buffers stay as the module built them (on the CPU),
so tables computed in ``__init__`` (rotary frequencies, masks) survive. ``setup()`` then hands the
model to the strategy, which calls :meth:`Materializer.materialize` on the part its rank holds:
the whole model (ddp, zero1, single, dp), one FSDP unit at a time just before it is sharded, one
pipeline stage, or each model-parallel unit on its own device.

A materialised module is initialised under a seed drawn from ``train.seed`` and the module's
name in the model, by its own ``reset_parameters()`` and then by the model's own per-module init
where it has one (Hugging Face's ``_init_weights``); a model-level ``init_weights()`` runs once
after all of them where the whole model is materialised (model_init.py says which wins). The
weights therefore do not depend on how the model is split or on the number of processes (a
2-process fsdp run starts from exactly the weights of a 1-process run), but they are not those
an eager ``build()`` under ``torch.manual_seed`` gives. Tied weights stay one tensor. A module
whose parameters nothing initialises is left uninitialised and recorded, so the Session can
refuse to train it until weights are loaded.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib
from typing import Iterator

import torch
from torch import nn

from phalanx.errors import PhalanxError
from phalanx.strategies.model_init import ModelInit
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

    def __init__(
        self,
        model: nn.Module,
        seed: int,
        *,
        in_place: bool = True,
        skip_init: weakref.WeakSet | None = None,
        strategy: str = "",
    ):
        self.root = model
        self.seed = seed
        self.skip_init = skip_init if skip_init is not None else weakref.WeakSet()
        self.strategy = strategy  # named where the model's init_weights() cannot run
        # in_place: a materialised tensor keeps its Python object, so an optimizer built on the meta
        # parameters holds the real ones (and a tied weight, one object, stays tied). False (fsdp):
        # the module gets a new tensor and the meta one stays empty, since the optimizer would
        # otherwise keep every whole unit alive after its sharding, until the optimizer is rebuilt
        # (fsdp remaps it by parameter names).
        self.in_place = in_place
        self.inits = ModelInit(model)
        # Not in place: a meta tensor's first holder (module, name), so a weight tied to it gets what
        # that holder has now. The meta tensor is kept, so its id is not reused.
        self._first: dict[int, tuple[torch.Tensor, nn.Module, str]] = {}
        self._ours: set[int] = set()  # in place: the tensors given memory here
        self.names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        # Modules left uninitialised: module name -> its tensors' names (see the uninitialised property).
        self._uninitialised: dict[str, list[str]] = {}
        # Tensors that count as initialised once written (ModelInit.checks_values): filled with NaN
        # when given memory and looked at by settle(), (module name, full tensor name, tensor).
        self._unchecked: list[tuple[str, str, torch.Tensor]] = []
        self._done: set[int] = set()
        self._live: set[int] = set()  # modules whose subtree holds tensors given memory here, to initialise
        self._whole_done = False

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """Give every still-meta tensor of ``module`` and its submodules memory on ``device`` and
        initialise it; tensors that exist already are moved there. Materialising the whole model
        (``module`` is the root) also runs the model's ``init_weights()`` where it has one."""
        with _forked(device):
            for sub in post_order(module):  # children first, so a parent's init sees initialised children
                self._own_once(sub, device)
            if module is self.root:
                self._whole_model_init()

    def materialize_own(self, module: nn.Module, device: torch.device) -> None:
        """The same for ``module``'s own tensors only; a module is handled once (a unit sharded
        since is not touched again when its parent is materialised). The root, last, completes the
        model: its ``init_weights()`` runs then."""
        with _forked(device):
            self._own_once(module, device)
            if module is self.root:
                self._whole_model_init()

    def needs_whole_model_init(self) -> bool:
        """Whether the model's ``init_weights()`` is to run: it has one, and tensors to initialise."""
        if self.inits.whole is None:
            return False
        return any(m not in self.skip_init and any(t.is_meta for t in _own(m)) for m in self.root.modules())

    def settle(self) -> None:
        """Record the written-checked tensors given memory so far that no initialiser wrote (NaN left).
        fsdp calls it before it shards a unit, while every rank holds the unit whole."""
        for module, name, tensor in self._unchecked:
            if bool(tensor.isnan().any()):
                self._uninitialised.setdefault(module or "(the model)", []).append(name)
        self._unchecked.clear()

    @property
    def uninitialised(self) -> dict[str, list[str]]:
        """Modules whose tensors got memory here and no initial value: module name -> tensor names."""
        if not self._whole_done and self._live and self.inits.whole is not None:
            raise PhalanxError(whole_model_refusal(self.strategy, self.inits.label(), "in parts, each rank its own"))
        self.settle()
        return self._uninitialised

    def _own_once(self, module: nn.Module, device: torch.device) -> None:
        if id(module) not in self._done:
            self._done.add(id(module))
            self._initialise(module, self._allocate(module, device))

    def _allocate(self, module: nn.Module, device: torch.device) -> tuple[list[str], list[str]]:
        """Memory for ``module``'s own meta tensors; returns their names, and those of the tensors it
        holds that were given memory here before (weights tied to an earlier module's)."""
        prefix = self.names.get(id(module), "")
        checked = self.inits.checks_values(module) and module not in self.skip_init
        fresh, tied = [], []
        for name, tensor in _named_own(module):
            first = self._first.get(id(tensor))
            if first is not None:  # a weight tied to one given memory (and initialised) already
                setattr(module, name, getattr(first[1], first[2]))
                tied.append(name)
            elif not tensor.is_meta:
                if id(tensor) in self._ours:
                    tied.append(name)
                if tensor.device != device:  # built for real: moved as .to() moves it, same object
                    with torch.no_grad():
                        tensor.data = tensor.data.to(device)
            else:
                fresh.append(name)
                new = _on(tensor, device, fill_nan=checked)
                if self.in_place:
                    _swap(tensor, new, prefix, name)  # keeps the Python object
                    self._ours.add(id(tensor))
                    new = tensor
                else:
                    self._first[id(tensor)] = (tensor, module, name)
                    setattr(module, name, new)
                if checked and new.is_floating_point():
                    self._unchecked.append((prefix, f"{prefix}.{name}" if prefix else name, new))
        return fresh, tied

    def _initialise(self, module: nn.Module, allocated: tuple[list[str], list[str]]) -> None:
        fresh, tied = allocated
        name = self.names.get(id(module), "")
        if module in self.skip_init:
            if fresh:  # init_module(initialize=False): to be loaded
                self._uninitialised[name or "(the model)"] = [f"{name}.{n}" if name else n for n in fresh]
            return
        # Any module below, not only a child: model_parallel materialises units inside a list it
        # never materialises itself.
        if fresh or tied or any(id(below) in self._live for below in module.modules()):
            self._live.add(id(module))
        else:
            return  # nothing in it was given memory here: built for real, or loaded
        steps = self.inits.steps(module, own_fresh=bool(fresh))
        if not steps:
            if fresh and not self.inits.checks_values(module):
                self._uninitialised[name or "(the model)"] = [f"{name}.{n}" if name else n for n in fresh]
            return
        torch.manual_seed(self._seed_of(name))
        # A tied weight is initialised once, by its first holder in the model's order (the embedding
        # before the output layer): in an eager build the tie is made after both inits, so the
        # second holder's init wrote a tensor that the tie then dropped (transformers marks tie
        # targets as initialised for the same reason). Here it writes a stand-in.
        with torch.no_grad(), _standing_in(module, tied):  # no_grad: as transformers' initialize_weights runs
            for step in steps:
                step()

    def _whole_model_init(self) -> None:
        if self.inits.whole is None or self._whole_done or not self._live:
            return
        self._whole_done = True
        torch.manual_seed(self._seed_of("(init_weights)"))  # no module has this name: a seed of its own
        with torch.no_grad():
            self.inits.whole()

    def _seed_of(self, name: str) -> int:
        # A stable hash (not Python's, which is salted per process) of the module's name.
        return (self.seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


@contextlib.contextmanager
def _forked(device: torch.device) -> Iterator[None]:
    # One fork for the whole pass, over every GPU (a module's seed reaches all of them), so the
    # training's own generators are as they were before set-up.
    devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


@contextlib.contextmanager
def _standing_in(module: nn.Module, names: list[str]) -> Iterator[None]:
    """``module``'s tensors ``names`` replaced by meta tensors of their shape for the block."""
    kept = {name: getattr(module, name) for name in names}
    for name, tensor in kept.items():
        stand_in = torch.empty_like(tensor, device="meta")
        setattr(
            module, name, nn.Parameter(stand_in, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else stand_in
        )
    try:
        yield
    finally:
        for name, tensor in kept.items():
            setattr(module, name, tensor)


def _named_own(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _own(module: nn.Module) -> list[torch.Tensor]:
    return [t for _, t in _named_own(module)]


def whole_model_refusal(strategy: str, init: str, how: str) -> str:
    """The one line refusing a model-level ``init_weights()`` (``init``) that ``strategy`` cannot run,
    since it materialises the model ``how``."""
    return (
        f"strategy {strategy} materialises the model {how}, so {init}, which initialises the whole model "
        "at once, cannot run on a model built under session.init_module(); give its modules reset_parameters() "
        "(run per module), build the model outside init_module(), or build it under "
        "init_module(initialize=False) and load its weights"
    )


def _on(tensor: torch.Tensor, device: torch.device, *, fill_nan: bool = False) -> torch.Tensor:
    """Memory on ``device`` for the meta ``tensor``, of its class and with its attributes (a
    Parameter subclass, flags set on a parameter in ``__init__``); NaN where ``fill_nan`` (floating
    point only), so that what no initialiser writes shows."""
    new = torch.empty_like(tensor, device=device)
    if fill_nan and new.is_floating_point():
        new.fill_(float("nan"))
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
        "have no reset_parameters(), and no init of the model's own wrote them, so their weights were never "
        "initialised; give the class a reset_parameters() that initialises its own parameters, or load weights with "
        "session.load_weights(...) before the first forward"
    )
