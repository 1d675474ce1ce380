"""Which DataLoaders train, and the guards that keep a wrong guess from training silently.

The rule (runtime/data.loader_roles): a shuffling loader trains; where a ``setup()`` call holds an
optimizer and no shuffling loader, and no training loader is set up yet, its first loader trains
too (ordered data); every other loader evaluates; ``setup_loader(loader, train=...)`` decides
explicitly. A loader's role decides its sharding (a training loader's ``batch_size`` is the global
batch, split over ranks and micro-steps; an evaluation loader's is per process), so a wrong one
trains on the wrong batches or evaluates on padded ones. What is refused, in one line each:

- a backward whose batch came from an evaluation loader: the last batch handed out was one of its,
  its pass is still going, and no training loader handed out a batch in this accumulation window
  (a validation batch drawn between a training forward and its backward is not refused);
- a backward when the loader taken as the training loader by the ordered rule handed out no batch
  in this window: the training data comes from elsewhere, so that loader evaluates;
- another training loader set up after the ordered rule chose one.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, IterableDataset

from phalanx.errors import PhalanxError
from phalanx.runtime.data import DeviceLoader, loader_roles, shuffles


class LoaderRoles:
    def __init__(self, print_main: Callable[..., None]):
        self.print_main = print_main
        self.implicit: DeviceLoader | None = None  # the ordered loader the rule made a training loader
        self._explicit: set[int] = set()  # loaders whose role setup_loader() gave
        self._trained = False  # a training loader handed out a batch in this accumulation window
        self._last: DeviceLoader | None = None

    def classify(self, objects: tuple, set_up: list[DeviceLoader]) -> dict[int, tuple[bool, bool]]:
        """Each DataLoader of one setup() call (by position): whether it trains, and whether only
        the ordered rule made it train (it does not shuffle)."""
        places = [i for i, obj in enumerate(objects) if isinstance(obj, DataLoader)]
        given = [shuffles(objects[i]) for i in places]
        roles = loader_roles(
            given,
            with_optimizer=any(isinstance(obj, torch.optim.Optimizer) for obj in objects),
            training_set_up=any(loader.train for loader in set_up),
        )
        if roles != given:
            self.print_main(
                "phalanx: the DataLoader given to setup() does not shuffle; it is taken as the training loader "
                "(the first loader of a setup() call with an optimizer, where none shuffles); to evaluate with it, "
                "set it up with session.setup_loader(loader, train=False)"
            )
        return {i: (train, train and not shuffled) for i, train, shuffled in zip(places, roles, given)}

    def before_setup(self, train: bool) -> None:
        """Before a training loader joins: refuse it where the ordered rule chose one already."""
        if train and self.implicit is not None:
            raise PhalanxError(
                "a training loader is set up after setup() took an ordered DataLoader given with the optimizer as "
                "the training loader; set that one up with session.setup_loader(loader, train=False) to evaluate "
                "with it, or give both loaders with session.setup_loader(loader, train=True)"
            )

    def taken(self, wrapped: DeviceLoader, *, implicit: bool, explicit: bool) -> None:
        if implicit:
            self.implicit = wrapped
        if explicit:
            self._explicit.add(id(wrapped))

    def on_batch(self, loader: DeviceLoader) -> None:
        self._last = loader
        if loader.train:
            self._trained = True

    def window_done(self) -> None:
        self._trained = False

    def check_backward(self) -> None:
        if self._trained:
            return
        last = self._last
        if last is not None and not last.train and last.passing:
            how = (
                "set up with session.setup_loader(loader, train=False)"
                if id(last) in self._explicit
                else "setup() took the DataLoader for evaluation: it does not shuffle"
            )
            shuffle = "" if _iterable(last.loader) else ", or build it with shuffle=True"
            raise PhalanxError(
                f"session.backward() got a loss from an evaluation loader's batch ({how}); set it up for training "
                f"with session.setup_loader(loader, train=True){shuffle}"
            )
        if self.implicit is not None:
            raise PhalanxError(
                "session.backward() came without a batch of the loader setup() took as the training loader (an "
                "ordered DataLoader given with the optimizer), so the training data comes from elsewhere; if that "
                "loader evaluates, set it up with session.setup_loader(loader, train=False)"
            )


def _iterable(loader: Any) -> bool:
    return isinstance(getattr(loader, "dataset", None), IterableDataset)
