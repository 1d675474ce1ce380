"""Every private torch name phalanx uses, in one place.

A torch upgrade that renames or removes one of them then breaks this module, where its unit tests
(tests/unit/test_torch_compat.py) look, instead of a training run somewhere else. Each entry says
which torch versions it was checked on and what happens when the name is missing: a fallback on
public API, or a :class:`PhalanxError` naming the setting to change. No other module of phalanx
reaches a private torch name (tests/unit/test_private_names.py walks the source to keep it so).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import RandomSampler

from phalanx.errors import PhalanxError

# -- DistributedDataParallel's reducer (strategy.ddp.find_unused_parameters: auto) -------------
# Why surgery and not a second, public DistributedDataParallel: strategies/unused.py.

# What ddp_rebuild_reducer uses, as DDP's own _update_process_group path does, and the arguments of
# _ddp_init_helper. Checked on torch 2.13.
_REBUILD_NAMES = (
    "_remove_autograd_hooks",
    "_build_params_for_reducer",
    "_ddp_init_helper",
    "_build_debug_param_to_name_mapping",
    "_has_rebuilt_buckets",
    "_comm_hooks",
)
_INIT_HELPER_ARGS = ["parameters", "expect_sparse_gradient", "param_to_name_mapping", "static_graph"]


def ddp_reducer_parameters(ddp: DistributedDataParallel) -> list[nn.Parameter]:
    """The parameters DDP's reducer waits for a gradient of, in the reducer's order.

    Checked on torch 2.13 (``DistributedDataParallel._build_params_for_reducer``). Fallback: the
    same rule from public attributes (requires grad, not in ``parameters_to_ignore``, shared once)."""
    build = getattr(ddp, "_build_params_for_reducer", None)
    if build is not None:
        return list(build()[0])
    ignored = getattr(ddp, "parameters_to_ignore", ())
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for module_name, module in ddp.module.named_modules():
        for name, param in module.named_parameters(recurse=False):
            # DDP spells a root parameter ".weight" too; matched as it spells it.
            if param.requires_grad and f"{module_name}.{name}" not in ignored and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def ddp_reducer_finalized(ddp: DistributedDataParallel) -> bool | None:
    """Whether the reducer got every gradient it waited for in the last synchronised backward;
    None when this torch cannot say (the caller then leaves the error to DDP, one step later).

    Checked on torch 2.13 (``Reducer._check_reducer_finalized`` raises RuntimeError when not)."""
    check = getattr(ddp.reducer, "_check_reducer_finalized", None)
    if check is None:
        return None
    try:
        check()
    except RuntimeError:
        return False
    return True


def ddp_can_rebuild_reducer(ddp: DistributedDataParallel) -> bool:
    """Whether :func:`ddp_rebuild_reducer` works on this torch: asked once, before training, so a
    torch without it keeps DDP's search on (correct, slower) instead of failing after step 1.

    Checked on torch 2.13."""
    if not all(hasattr(ddp, name) for name in _REBUILD_NAMES):
        return False
    try:
        return list(inspect.signature(ddp._ddp_init_helper).parameters) == _INIT_HELPER_ARGS
    except (TypeError, ValueError):
        return False


def ddp_rebuild_reducer(ddp: DistributedDataParallel, *, find_unused_parameters: bool) -> None:
    """Give ``ddp`` a new reducer with another unused-parameter mode, keeping the module, its
    parameters and their gradients (with gradient_as_bucket_view the new buckets take the current
    gradients over). DDP's own construction path, as its ``_update_process_group`` takes for a new
    group; registered communication hooks are registered again.

    Checked on torch 2.13; call :func:`ddp_can_rebuild_reducer` first (this raises without it)."""
    if not ddp_can_rebuild_reducer(ddp):
        raise PhalanxError(
            f"this torch ({torch.__version__}) cannot rebuild DDP's reducer; "
            "set strategy.ddp.find_unused_parameters: true or false"
        )
    ddp._remove_autograd_hooks()
    ddp.find_unused_parameters = find_unused_parameters
    params, expect_sparse = ddp._build_params_for_reducer()
    ddp._ddp_init_helper(params, expect_sparse, ddp._build_debug_param_to_name_mapping(params), ddp.static_graph)
    ddp._has_rebuilt_buckets = False  # the new reducer orders its buckets by backward again
    hooks, ddp._comm_hooks = ddp._comm_hooks, []
    for hook, state in hooks:
        ddp.register_comm_hook(state, hook)


def ddp_intercept_post_forward(ddp: DistributedDataParallel, post_forward: Callable[[Any], Any]) -> bool:
    """Run ``post_forward(output)`` in place of DDP's step after each forward of this instance (where
    the reducer is prepared for backward and the graph search runs); it calls
    :func:`ddp_post_forward` for DDP's own. False: this torch has no such step, nothing was changed.

    Checked on torch 2.13 (``DistributedDataParallel.forward`` calls ``self._post_forward(output)``)."""
    if not callable(getattr(type(ddp), "_post_forward", None)):
        return False
    ddp._post_forward = post_forward  # an instance attribute: other DDP objects keep the method
    return True


def ddp_restore_post_forward(ddp: DistributedDataParallel) -> None:
    """Undo :func:`ddp_intercept_post_forward`. Checked on torch 2.13."""
    vars(ddp).pop("_post_forward", None)


def ddp_post_forward(ddp: DistributedDataParallel, output: Any, search_guard: Callable[[], Any]) -> Any:
    """DDP's own step after a forward, with the reducer's graph search (and what torch prints from
    it) inside the context manager ``search_guard()``.

    Checked on torch 2.13 (``_post_forward`` calls ``self.reducer.prepare_for_backward(outputs)``)."""
    reducer = ddp.reducer
    ddp.reducer = _GuardedSearch(reducer, search_guard)
    try:
        return DistributedDataParallel._post_forward(ddp, output)
    finally:
        ddp.reducer = reducer


class _GuardedSearch:
    """DDP's reducer for the duration of one ``_post_forward``: its graph search runs inside a
    guard; everything else passes through."""

    def __init__(self, reducer: Any, guard: Callable[[], Any]):
        self._reducer = reducer
        self._guard = guard

    def prepare_for_backward(self, outputs: list[torch.Tensor]) -> None:
        with self._guard():
            self._reducer.prepare_for_backward(outputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


# -- torch.compile --------------------------------------------------------------------------


def compiled_original(model: nn.Module) -> nn.Module | None:
    """The module inside a ``torch.compile`` wrapper; None for any other model.

    Checked on torch 2.13 (``torch._dynamo.eval_frame.OptimizedModule`` and its ``_orig_mod``).
    Without torch._dynamo imported nothing can have been compiled (and importing it costs time).
    Fallback when the class moved: any module holding an ``_orig_mod`` module."""
    if "torch._dynamo" not in sys.modules:
        return None
    wrapper = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    if wrapper is not None and not isinstance(model, wrapper):
        return None
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else None


# -- optimizer implementations (compute.optimizer_impl) -------------------------------------


def foreach_kernel_devices() -> list[str]:
    """Device types with native foreach optimizer kernels.

    Checked on torch 2.13 (``torch.optim.optimizer._get_foreach_kernels_supported_devices``).
    Fallback: 2.13's list, less the private-use backend."""
    try:
        from torch.optim.optimizer import _get_foreach_kernels_supported_devices
    except ImportError:
        return ["cuda", "xpu", "mtia"]
    return list(_get_foreach_kernels_supported_devices())


def fused_kernel_devices() -> list[str]:
    """Device types with fused optimizer kernels.

    Checked on torch 2.13 (``torch.optim.optimizer._get_fused_kernels_supported_devices``).
    Fallback: 2.13's list, less the private-use backend."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
    except ImportError:
        return ["mps", "cuda", "xpu", "hpu", "cpu", "mtia"]
    return list(_get_fused_kernels_supported_devices())


# -- data -----------------------------------------------------------------------------------

_MISSING = object()


# -- a DataLoader's persistent workers (Session.close) ------------------------------------------
# A loader with persistent_workers keeps its iterator, and so its worker processes, in _iterator
# until the loader itself is collected. Collected inside a reference cycle, the iterator's
# __del__ may run after its index queues were finalised: the workers never get the None that ends
# them, and each join waits out its 5 s timeout (10 s for two workers, at a random later moment).
# Checked on torch 2.13; without the names the workers end at collection, as before.


def shutdown_persistent_workers(loader: torch.utils.data.DataLoader) -> bool:
    """End ``loader``'s persistent workers now; False when it has none running (or torch moved them)."""
    iterator = getattr(loader, "_iterator", None)
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:
        return False
    shutdown()
    loader._iterator = None  # the next pass starts new workers, as after the first one
    return True


def sampler_has_custom_num_samples(sampler: RandomSampler) -> bool:
    """Whether a RandomSampler was built with ``num_samples``.

    Checked on torch 2.13 (the argument is kept as ``_num_samples``, None when not given).
    Fallback: its public ``num_samples`` differs from the data's length."""
    given = getattr(sampler, "_num_samples", _MISSING)
    if given is _MISSING:
        return sampler.num_samples != len(sampler.data_source)  # type: ignore[arg-type]
    return given is not None


# -- checkpoints ----------------------------------------------------------------------------

# Private classes and functions that torch.distributed.checkpoint's pickled .metadata names (module,
# name), allowed by checkpoint/safe.py's unpickler. Checked on torch 2.13. A torch that renames one
# writes the new name; safe.py then refuses that file with its one-line error, nothing is executed.
DCP_METADATA_PRIVATE_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
    }
)


def dcp_set_element(root: dict, path: tuple, value: Any) -> None:
    """Put ``value`` into a nested state dict along a flattened checkpoint's object path (what the
    stock load planner does with a loaded non-tensor entry).

    Checked on torch 2.13 (``torch.distributed.checkpoint._traverse.set_element``). Fallback: the
    same walk (dicts for string keys, lists padded with None for integer ones)."""
    try:
        from torch.distributed.checkpoint._traverse import set_element
    except ImportError:
        _set_element(root, path, value)
    else:
        set_element(root, path, value)


def _set_element(root: dict, path: tuple, value: Any) -> None:
    container: Any = root
    for prev_key, key in zip(path[:-1], path[1:], strict=True):
        empty: Any = {} if isinstance(key, str) else []
        if isinstance(container, dict):
            container = container.setdefault(prev_key, empty)
        else:
            _pad(container, prev_key)
            if container[prev_key] is None:
                container[prev_key] = empty
            container = container[prev_key]
    if isinstance(path[-1], int):
        _pad(container, path[-1])
    container[path[-1]] = value


def _pad(items: list, index: int) -> None:
    items.extend([None] * (index + 1 - len(items)))


# -- tensors --------------------------------------------------------------------------------


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was made from; None for a tensor that is not a view.

    Checked on torch 2.13 (``Tensor._base``). Fallback: None (each tensor counts as its own)."""
    return getattr(tensor, "_base", None)


def make_subclass(cls: type, data: torch.Tensor) -> torch.Tensor:
    """``data`` as an instance of the torch.Tensor subclass ``cls``, not requiring grad.

    Checked on torch 2.13 (``torch.Tensor._make_subclass``). Fallback: ``Tensor.as_subclass``
    (public; the same for a tensor that does not require grad)."""
    make = getattr(torch.Tensor, "_make_subclass", None)
    if make is None:
        return data.detach().as_subclass(cls)
    return make(cls, data)


# -- BatchNorm layers (strategies/sync_batchnorm.py) ---------------------------------------------
# Every BatchNorm layer (BatchNorm1d/2d/3d, SyncBatchNorm, the lazy ones, a model's own subclasses)
# derives from torch.nn.modules.batchnorm._BatchNorm, which holds their parameters, buffers and
# reset_parameters() and has no public name. Checked on torch 2.13. Fallback: the base class
# BatchNorm1d and SyncBatchNorm share (the same class, reached through public ones).
BATCH_NORM_BASE: type = getattr(nn.modules.batchnorm, "_BatchNorm", None) or next(
    c for c in nn.BatchNorm1d.__mro__[1:] if c in nn.SyncBatchNorm.__mro__
)


# -- deferred construction (session.init_module) ----------------------------------------------
# torch modules that initialise their own parameters in a private method instead of a public
# reset_parameters(). Checked on torch 2.13; a name that is gone leaves the module without an
# initialiser, which strategies/construction.py reports in one line.
_PRIVATE_INITIALISERS = {nn.MultiheadAttention: "_reset_parameters"}


def module_initializer(module: nn.Module) -> Callable[[], None] | None:
    """The method that (re)initialises ``module``'s own parameters and buffers: its public
    ``reset_parameters()``, or the private one of the torch classes above; None when it has none."""
    public = getattr(module, "reset_parameters", None)
    if callable(public):
        return public
    for cls, name in _PRIVATE_INITIALISERS.items():
        if isinstance(module, cls) and callable(getattr(module, name, None)):
            return getattr(module, name)
    return None


def tensor_version(tensor: torch.Tensor) -> int | None:
    """How many times ``tensor`` was written in place (also on the meta device, where nothing is
    stored): what strategies/model_init.py watches to see which parameters an initialiser writes.

    Checked on torch 2.13 (``Tensor._version``, the counter autograd checks saved tensors with; a
    write through ``.data`` does not count). None where the name is gone: then an initialiser is
    taken to write its module's own parameters only."""
    return getattr(tensor, "_version", None)


# -- the gradient noise scale under fsdp (session/noise.py) ---------------------------------------
def fsdp_measuring_reduce_scatter(add: Callable[[torch.Tensor], None], armed: Callable[[], bool]) -> Any:
    """A reduce-scatter for ``FSDPModule.set_custom_reduce_scatter`` (public) that hands each input
    (this rank's unsharded gradient of one unit, before it is averaged) to ``add`` while ``armed()``,
    then reduces as FSDP's default does. It subclasses FSDP2's default communication class, whose
    module path is private. Checked on torch 2.13; None where the class is gone (the noise scale is
    then not measured under fsdp without accumulation)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:
        return None

    class MeasuringReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if armed():
                add(input_tensor)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return MeasuringReduceScatter()


# -- multiplying many gradients at once (session.backward(loss, items=n)) -----------------------
# torch._foreach_mul_ is one kernel launch per chunk of tensors instead of one per tensor, and takes
# the factor as a 0-d tensor, so a factor still on the device is not read back. Checked on torch
# 2.13; without it each tensor is multiplied on its own (same values, more launches).


def scale_tensors(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor of ``tensors`` (one device and dtype) in place by the 0-d ``factor``."""
    foreach = getattr(torch, "_foreach_mul_", None)
    if foreach is not None:
        try:
            foreach(tensors, factor)
            return
        except (RuntimeError, TypeError):  # an older torch without the tensor-scalar overload
            pass
    for tensor in tensors:
        tensor.mul_(factor)


def steps_under_inf(optimizer: Any) -> bool:
    """Whether GradScaler calls this optimizer's step even on an overflow (fused kernels take the
    inf flag and skip the update on the device): its step hooks then fire on skipped steps too."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


# -- a process group's timeout, after the group exists (strategies/base.py's mesh) --------------
# init_device_mesh takes no timeout: its groups get torch's default (30 min; 10 min for a group
# split off NCCL's), shorter than the one phalanx gives the world (strategies/collective_timeout.py).
# Checked on torch 2.13; without the name the mesh's groups keep torch's default.


def set_group_timeout(group: Any, timeout: Any) -> bool:
    """Make ``group``'s collectives wait up to ``timeout`` (a timedelta); False where torch cannot."""
    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return False
    setter(timeout, group)
    return True
