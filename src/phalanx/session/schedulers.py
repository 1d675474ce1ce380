"""Who steps each LR scheduler passed to ``setup()``: phalanx, once per optimizer step, or the script.

Vision scripts write ``StepLR(optimizer, step_size=30)`` and call ``scheduler.step()`` once per
epoch; language-model scripts call it once per iteration. phalanx cannot tell the two apart from
the object, and stepping a per-epoch scheduler per optimizer step makes the learning rate fall
10x at step 31 instead of epoch 31. So a scheduler the script steps itself stays the script's:
phalanx never steps it, and still saves and restores it (the lr scaling rule still applies, around
each optimizer step). The script's calls are found in its source before the first step (the
function that calls ``setup()``, and the functions it hands the scheduler to: script_steps), and
failing that at run time, at the first optimizer step after the script's call.

Under accumulation an iteration of the script is a micro-step, so a per-iteration
``scheduler.step()`` comes several times per optimizer step: only a call at a global-batch
boundary counts (after the step that ended a window, or before the first), as in the one-process
run without accumulation where every iteration ends with the optimizer's step.
"""

from __future__ import annotations

import ast
import linecache
import warnings
from types import FrameType
from typing import Any, Callable


class Schedulers:
    """``mid_window``: True between the micro-steps of a global batch; ``say``: rank 0's print."""

    def __init__(self, mid_window: Callable[[], bool], say: Callable[[str], None]):
        self.mid_window = mid_window
        self.say = say
        self.all: list[Any] = []  # set-up order: what a checkpoint saves
        self._ours: list[_Ours] = []
        self._dropped_said = False

    def add(self, scheduler: Any, caller: FrameType | None, *, needs_metric: bool = False) -> None:
        self.all.append(scheduler)
        if needs_metric:
            self._give(scheduler)
            self.say(
                f"phalanx: the script steps {type(scheduler).__name__} itself (it needs a metric); "
                "phalanx saves and restores it"
            )
            return
        where = script_steps(scheduler, caller)
        if where is not None:
            self._give(scheduler)
            self.say(
                f"phalanx: the script steps {type(scheduler).__name__} itself ({where}), so phalanx leaves it to "
                "the script and saves and restores it"
            )
            return
        self._ours.append(_Ours(scheduler))

    @property
    def stepped_by_phalanx(self) -> bool:
        return bool(self._ours)

    def before_step(self) -> None:
        """A scheduler of phalanx's whose counter moved since phalanx stepped it: the script steps it
        too. It becomes the script's, put back where the script's own calls alone would have left it."""
        for ours in list(self._ours):
            calls = ours.scheduler.last_epoch - ours.seen
            if calls:
                self._ours.remove(ours)
                self._take_back(ours, calls)

    def step(self, times: int) -> None:
        """phalanx's step of its schedulers, ``times`` each (batch.adaptive's k)."""
        if all(ours.steps for ours in self._ours):  # torch's two warnings below come only from a first step
            self._step_each(times)
            return
        with warnings.catch_warnings():
            # A sharding strategy steps a new optimizer built on the scheduler's param groups;
            # torch cannot see that the step came first, phalanx guarantees it.
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*optimizer.step", category=UserWarning)
            warnings.filterwarnings(
                "ignore", message="Seems like `optimizer.step\\(\\)` has been overridden", category=UserWarning
            )
            self._step_each(times)

    def _step_each(self, times: int) -> None:
        for _ in range(times):
            for ours in self._ours:
                ours.scheduler.step()
        for ours in self._ours:
            ours.stepped()

    def mark(self) -> None:
        """The counters as phalanx (or a checkpoint) left them: a later change is the script's."""
        for ours in self._ours:
            ours.seen = ours.scheduler.last_epoch

    def _give(self, scheduler: Any) -> None:
        """Make the script's ``scheduler.step()`` count only at a global-batch boundary. The method
        is swapped on a subclass of the scheduler's own class: an instance attribute would land in
        the scheduler's state_dict (its ``__dict__``) and in every checkpoint."""
        cls, mid_window, dropped = type(scheduler), self.mid_window, self._dropped

        def step(this: Any, *args: Any, **kwargs: Any) -> None:
            if mid_window():
                dropped()
                return
            cls.step(this, *args, **kwargs)

        scheduler.__class__ = type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__})

    def _dropped(self) -> None:
        if not self._dropped_said:
            self._dropped_said = True
            self.say(
                "phalanx: scheduler.step() is called between the micro-steps of a global batch; only the call after "
                "each optimizer step counts, as in a run with one micro-step per optimizer step"
            )

    def _take_back(self, ours: _Ours, calls: int) -> None:
        scheduler = ours.scheduler
        own_step = type(scheduler).step
        scheduler.load_state_dict(ours.initial)
        for group, lr in zip(scheduler.optimizer.param_groups, ours.initial_lrs):
            group["lr"] = lr
        self._give(scheduler)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(calls):
                own_step(scheduler)
        name = type(scheduler).__name__
        if ours.changed_lr:
            effect = (
                f"the {ours.steps} optimizer step(s) before it used learning rates phalanx's own stepping had "
                "changed, so this run differs from the script's own schedule"
            )
        else:
            effect = f"no learning rate had changed in the {ours.steps} step(s) before it, so the schedule is exact"
        self.say(
            f"phalanx: the script called {name}.step() itself, which phalanx had stepped once per optimizer step: "
            f"it is the script's from now on, set back to the script's {calls} call(s); {effect}. "
            "Write scheduler.step() in the file that calls session.setup() for phalanx to see it before the first step"
        )


class _Ours:
    """A scheduler phalanx steps, with what it needs to hand it back to the script exactly."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.seen = scheduler.last_epoch
        self.initial = scheduler.state_dict()
        self.initial_lrs = [group["lr"] for group in scheduler.optimizer.param_groups]
        self.steps = 0
        self.changed_lr = False

    def stepped(self) -> None:
        self.steps += 1
        if not self.changed_lr:
            self.changed_lr = [group["lr"] for group in self.scheduler.optimizer.param_groups] != self.initial_lrs
        self.seen = self.scheduler.last_epoch


def script_steps(scheduler: Any, caller: FrameType | None) -> str | None:
    """Where the script calls ``.step()`` on ``scheduler`` ("train.py:81"), None where no call is
    found or the source cannot be read. Searched: the body of the function that called ``setup()``
    (the whole file when that is module-level code), through a name bound to the scheduler in its
    frame or an attribute of one of its objects (``self.scheduler``), and one call deeper, the
    functions of the file it hands the scheduler to (``train(..., scheduler)``). Not the whole
    file: a reference loop elsewhere may step another scheduler of the same name."""
    if caller is None:
        return None
    names, attributes = _names_of(scheduler, caller)
    if not names and not attributes:
        return None
    filename = caller.f_code.co_filename
    source = "".join(linecache.getlines(filename, caller.f_globals))
    try:
        tree = ast.parse(source) if source else None
    except (SyntaxError, ValueError):
        tree = None
    scope = tree and _function_of(tree, caller.f_code)
    if scope is None:
        return None
    line = _step_call(scope, names, attributes)
    for callee, parameter in _handed_to(tree, scope, names) if line is None else ():
        line = _step_call(callee, {parameter}, set())
        if line is not None:
            break
    return None if line is None else f"{filename.rsplit('/', 1)[-1]}:{line}"


def _function_of(tree: ast.Module, code: Any) -> ast.AST | None:
    if code.co_name == "<module>":
        return tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            if min([node.lineno] + [d.lineno for d in node.decorator_list]) == code.co_firstlineno:
                return node
    return None


def _step_call(scope: ast.AST, names: set[str], attributes: set[str]) -> int | None:
    for node in ast.walk(scope):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step"):
            continue
        target = node.func.value
        if (isinstance(target, ast.Name) and target.id in names) or (
            isinstance(target, ast.Attribute) and target.attr in attributes
        ):
            return node.lineno
    return None


def _handed_to(tree: ast.Module, scope: ast.AST, names: set[str]) -> list[tuple[ast.AST, str]]:
    """(function of the file, its parameter) for each call in ``scope`` that passes the scheduler."""
    functions = {
        node.name: node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    found = []
    for node in ast.walk(scope):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions):
            continue
        callee = functions[node.func.id]
        params = [a.arg for a in (*callee.args.posonlyargs, *callee.args.args)]
        for i, arg in enumerate(node.args):
            if isinstance(arg, ast.Name) and arg.id in names and i < len(params):
                found.append((callee, params[i]))
        for keyword in node.keywords:
            if isinstance(keyword.value, ast.Name) and keyword.value.id in names and keyword.arg:
                found.append((callee, keyword.arg))
    return found


def _names_of(obj: Any, frame: FrameType) -> tuple[set[str], set[str]]:
    names = {name for scope in (frame.f_globals, frame.f_locals) for name, value in scope.items() if value is obj}
    # One level into the frame's own objects (``self.scheduler``, ``state.scheduler``); globals are
    # mostly modules, whose attributes are not the script's.
    attributes = {attr for value in frame.f_locals.values() for attr, held in _attributes(value) if held is obj}
    return names, attributes


def _attributes(value: Any) -> list[tuple[str, Any]]:
    try:
        return list(vars(value).items())
    except TypeError:
        return []
