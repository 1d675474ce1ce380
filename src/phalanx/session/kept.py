"""Values a script keeps itself, in the checkpoint: ``session.keep(iter_num=0, best_val=inf)``.

A one-GPU loop often counts its own steps (nanoGPT's ``iter_num``, with the learning rate computed
from it) and remembers a best validation loss or an exponential moving average. A resume that
restores phalanx's counters but not those trains too long, or from the wrong learning rate,
silently. What ``keep`` returns holds them as attributes; every checkpoint saves them (rank 0's
values), and a resumed run gets them back, whether ``keep`` is called before or after the resume.
A value with ``state_dict()`` / ``load_state_dict()`` (an EMA model, a metric object) is saved
through them and restored in place; any other value must be what ``torch.load(weights_only=True)``
reads back (numbers, strings, lists, dicts, tensors).
"""

from __future__ import annotations

from typing import Any

from phalanx.errors import PhalanxError


class Kept:
    """The values of one ``session.keep(...)`` call, as attributes."""

    def __init__(self, values: dict[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"session.keep() holds no value named {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._values:
            raise PhalanxError(
                f"session.keep() holds {', '.join(self._values)}, not {name!r}; name every value the checkpoint "
                f"should keep when calling it: session.keep({name}=...)"
            )
        if not (_stateful(value) or _plain(value)):
            raise _unkept(name, value)  # now, not at a save hours later
        self._values[name] = value

    def names(self) -> list[str]:
        return list(self._values)

    def state_dict(self) -> dict[str, Any]:
        out = {}
        for name, value in self._values.items():
            if _stateful(value):
                out[name] = value.state_dict()
            elif _plain(value):
                out[name] = value
            else:
                raise _unkept(name, value)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            if name not in self._values:
                continue  # kept by the run that saved, not (or not yet) by this one
            if _stateful(self._values[name]):
                self._values[name].load_state_dict(value)
            else:
                self._values[name] = value

    def __repr__(self) -> str:
        return "Kept(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"


def _unkept(name: str, value: Any) -> PhalanxError:
    return PhalanxError(
        f"session.keep()'s {name} is a {type(value).__name__}, which a checkpoint cannot hold safely; keep numbers, "
        "strings, lists, dicts and tensors (e.g. float(x) for a NumPy number), or an object with state_dict() and "
        "load_state_dict()"
    )


def _plain(value: Any) -> bool:
    """What torch.load(weights_only=True) gives back as it was saved."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return False


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
