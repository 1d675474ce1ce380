"""Sharding data over data-parallel processes, and moving batches to the device.

The global sample order never depends on the number of processes: every rank computes the same
order, and one optimizer step consumes the next global batch of it whatever W is, which is what
makes N processes train like one. A training order, shuffled or not, is dealt out in micro-batches
(rank r takes the r-th, (r+W)-th, ... run of ``m`` consecutive positions, m its micro batch): the
layout of runtime/shares.py, in which a micro-step of W processes holds what one process's
micro-step of W*m holds, and each process's micro-batch is one process's micro-batch of m, so even
BatchNorm sees the same groups of samples (docs/data.md). An evaluation order is dealt out position
by position (rank r takes r, r+W, r+2W, ...), which gather_for_metrics undoes.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from phalanx._torch_compat import sampler_has_custom_num_samples, shutdown_persistent_workers
from phalanx.config.schema import DataConfig
from phalanx.errors import PhalanxError
from phalanx.runtime.pinning import choose_pin, first_batch
from phalanx.runtime.presplit import presplit
from phalanx.runtime.shares import StreamShare
from phalanx.runtime.transfer import PlainTransfer, StreamTransfer, Transfer, staged
from phalanx.topology import cpu_count
from phalanx.util.tree import NotConcatenable, concat_batches, layout, map_tensors, same_layout

# `data.num_workers: auto` never goes above this: each worker holds its own copy of the dataset
# object, and past a handful of workers most loaders are no longer the bottleneck.
MAX_AUTO_WORKERS = 8
_END = object()  # the end of a pass, where a batch may be anything, None included


class ShardedSampler(Sampler[int]):
    """This rank's share of one global order.

    ``multiple_of`` is what the global order is padded (by wrapping around) or cut (``drop_last``)
    to: the global batch for training, so every optimizer step is full; the world size for
    evaluation, so every rank runs the same number of batches (the padding is dropped again by
    ``Session.gather_for_metrics``).

    ``chunk``: the order (from ``start``) is dealt out in runs of ``chunk`` consecutive positions,
    rank r taking runs r, r+W, r+2W, ...: the per-rank micro batch for training (each global batch
    is then its micro-steps' blocks of W*chunk positions, each block cut into W shares, rank r taking
    the r-th: runtime/shares.py), 1 for evaluation (position by position). A last part shorter than
    W runs is cut into W equal contiguous shares (what is left over, fewer than W positions, is
    dropped: only a resume off a step boundary leaves one).
    """

    def __init__(
        self,
        dataset_len: int,
        rank: int,
        world_size: int,
        *,
        shuffle: bool,
        seed: int,
        multiple_of: int,
        drop_last: bool = False,
        chunk: int = 1,
    ):
        if dataset_len == 0:
            raise PhalanxError("the dataset is empty; nothing to train or evaluate on")
        self.dataset_len = dataset_len
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.multiple_of = multiple_of
        self.drop_last = drop_last
        self.chunk = chunk
        self.epoch = 0
        # Global position where the next pass starts (a resumed epoch); one pass uses it up.
        self.start = 0
        if drop_last and dataset_len < multiple_of:
            raise PhalanxError(
                "drop_last is on (data.drop_last or the DataLoader's drop_last=True) "
                f"but the dataset has {dataset_len} samples, "
                f"fewer than one global batch of {multiple_of}; lower batch.global_batch_size or turn drop_last off"
            )

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    @property
    def global_len(self) -> int:
        n, k = self.dataset_len, self.multiple_of
        return (n // k) * k if self.drop_last else -(-n // k) * k

    def global_order(self) -> torch.Tensor:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=g)
        else:
            order = torch.arange(self.dataset_len)
        total = self.global_len
        if total > self.dataset_len:
            order = order.repeat(-(-total // self.dataset_len))
        return order[:total]

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0
        return iter(deal(self.global_order()[start:], self.rank, self.world_size, self.chunk).tolist())

    def __len__(self) -> int:
        return (self.global_len - self.start) // self.world_size


def deal(order: torch.Tensor, rank: int, world_size: int, chunk: int) -> torch.Tensor:
    """``rank``'s positions of ``order``: runs rank, rank+W, ... of ``chunk`` consecutive ones, then
    its contiguous share of a last part shorter than W runs (the remainder of W is left out)."""
    whole = len(order) // (world_size * chunk) * world_size * chunk
    mine = order[:whole].view(-1, world_size, chunk)[:, rank].flatten()
    tail = order[whole:]
    part = len(tail) // world_size
    return torch.cat([mine, tail[rank * part : (rank + 1) * part]])


@dataclass
class LoaderState:
    """Where the most recent batch of an evaluation loader sits in the global order."""

    dataset_len: int
    world_size: int
    batch_start: int = 0  # this rank's local index of the batch's first sample


class DeviceLoader:
    """A sharded DataLoader that hands out batches already on the device."""

    def __init__(
        self,
        loader: DataLoader,
        sampler: ShardedSampler | None,
        device: torch.device,
        *,
        train: bool,
        non_blocking: bool,
        prefetch_to_device: bool = True,
        stream: StreamShare | None = None,
    ):
        self.loader = loader
        self.sampler = sampler
        self.stream = stream  # an iterable dataset's training share (runtime/shares.py)
        self.device = device
        self.train = train
        self.non_blocking = non_blocking
        side_stream = prefetch_to_device and device.type == "cuda"
        self.transfer: Transfer = (StreamTransfer if side_stream else PlainTransfer)(device, non_blocking)
        # Fetching a batch early is safe only when workers load it: loading in this process would
        # move the dataset's random draws before the step's, so a resumed run would draw different ones.
        self.fetch_ahead = side_stream and loader.num_workers > 0
        # Positions matter only where gather_for_metrics drops padding: evaluation loaders.
        self.state = LoaderState(sampler.dataset_len, sampler.world_size) if sampler is not None and not train else None
        self.on_batch = None  # set by the Session to learn which loader is active
        self.on_wait = None  # set by the Session: seconds each batch took to arrive (metrics)
        self.on_start = None  # set by the Session: called before a training pass begins
        self.on_iterating = None  # set by the Session: called once the pass's iterator exists
        self.stop_when = None  # set by the Session: True once training must end (train.max_steps)
        # Set by the Session under batch.adaptive: how many of the loader's batches the next forward
        # takes at once (batch.max_micro_batch_size allowing); their samples, in order, as one batch.
        self.group = None
        self.last_group = 1  # the loader's batches in the batch handed out last
        self.say = None  # set by the Session: a line for the console (rank 0's)
        self._concat = True  # False once a batch could not be joined: one batch per forward from then on
        self.join_strictly = False  # set by the Session: ranks must take the same forwards (see _unjoined)
        self._pass_start = 0  # global position where the current pass began
        self._served = 0  # batches handed out in the current pass
        self._passes = 0  # passes started (iterators created)
        self.passing = 0  # passes being iterated now (a pass left by break ends when its iterator is dropped)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch if self.sampler is not None else 0

    @property
    def position(self) -> int | None:
        """Samples of this epoch's global order consumed by all ranks together (what a resumed run
        skips); None for iterable datasets, whose order phalanx does not control."""
        if self.sampler is None:
            return None
        return self._pass_start + self._served * (self.loader.batch_size or 1) * self.sampler.world_size

    def epoch_done(self) -> bool:
        """Every sample of this epoch's order has been handed out (False for iterable datasets)."""
        return self.sampler is not None and self.position >= self.sampler.global_len

    def resume_at(self, epoch: int, position: int | None) -> None:
        """Make the next pass of ``epoch`` start at global ``position`` (from a checkpoint)."""
        if self.sampler is None or position is None:
            return
        self.sampler.epoch = epoch
        self.sampler.start = self._pass_start = min(position, self.sampler.global_len)
        self._served = 0

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.stream.micro_batch_size if self.stream is not None else self.loader.batch_size

    def set_epoch(self, epoch: int) -> None:
        if self.sampler is not None:
            if epoch != self.sampler.epoch:
                self._pass_start = self._served = 0  # a new epoch: nothing of it consumed yet
            self.sampler.set_epoch(epoch)

    def close(self) -> None:
        """End the loader's persistent workers (Session.close): left to garbage collection, their
        shutdown can stall a later moment of the process by seconds (see _torch_compat)."""
        if self.loader.persistent_workers:
            shutdown_persistent_workers(self.loader)

    def __len__(self) -> int:
        if self.stream is not None:
            return self.stream.length(len(self.loader.dataset))  # TypeError without __len__, as a DataLoader
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self.on_start is not None:
            self.on_start(self)  # may resume from a checkpoint, which moves the sampler's start
        self._pass_start = self.sampler.start if self.sampler is not None else 0
        self._served = 0
        consumed = 0
        requested = time.perf_counter()  # starting workers is waiting for data too
        # Creating a DataLoader iterator draws from torch's RNG (its workers' base seed); a resumed
        # run restores the generators after that draw, where the uninterrupted run's state was.
        if self._passes and self.loader.persistent_workers and self.loader.num_workers > 0:
            # Persistent workers are seeded once, so torch skips the draw after the first pass; make
            # it anyway, so worker settings never change the random numbers the training loop draws.
            torch.empty((), dtype=torch.int64).random_(generator=self.loader.generator)
        self._passes += 1
        batches = iter(self.loader)
        if self.stream is not None:
            batches = self.stream.micro_batches(batches)
        if self.on_iterating is not None:
            self.on_iterating(self)
        # Positions, callbacks and waits count batches handed to the user, not batches fetched ahead.
        arriving = staged(batches, self.transfer, ahead=self.fetch_ahead)
        # A plain copy's handle is the batch itself: no call per batch to say so.
        ready = None if isinstance(self.transfer, PlainTransfer) else self.transfer.ready
        unjoined: deque[Any] = deque()  # taken to join, but shaped unlike the first: one forward each
        self.passing += 1
        try:
            while True:
                if unjoined:
                    out = unjoined.popleft()
                else:
                    nxt = next(arriving, _END)
                    if nxt is _END:
                        return
                    out = nxt if ready is None else ready(nxt)
                if self.stop_when is not None and self.stop_when():
                    return  # the pass ends as at the end of an epoch, so the script's own code after it runs
                taken = 1
                wanted = self.group() if self.group is not None and self._concat and not unjoined else 1
                shape = self._joinable(out) if wanted > 1 else None
                if shape is not None:
                    # The next batches of this pass join this one (fewer where the pass ends first).
                    rest = [h if ready is None else ready(h) for h in itertools.islice(arriving, wanted - 1)]
                    if same_layout(shape, rest):
                        out, taken = concat_batches([out, *rest]), 1 + len(rest)
                    else:
                        self._refuse_unjoined(shape, rest)
                        unjoined.extend(rest)
                    del rest  # the joined batch alone stays alive through the forward
                if self.on_wait is not None:
                    self.on_wait(time.perf_counter() - requested)
                if self.state is not None:
                    self.state.batch_start = consumed
                    consumed += _batch_len(out)
                self.last_group = taken
                if self.on_batch is not None:
                    self.on_batch(self)
                self._served += taken
                yield out
                requested = time.perf_counter()
        finally:
            self.passing -= 1

    def _refuse_unjoined(self, shape: Any, rest: list[Any]) -> None:
        """Batches of different shapes (padded to their own longest sample) take one forward each,
        which is exact, unless ranks must take the same forwards (sharded parameters are gathered
        in each one), where a rank whose shapes differ would leave the others waiting."""
        if self.join_strictly:
            other = next(b for b in rest if not same_layout(shape, [b]))
            try:
                theirs = layout(other)
            except NotConcatenable as why:
                theirs = str(why)
            raise PhalanxError(
                "batch.adaptive: the training loader's batches differ in shape beyond the batch dimension "
                f"({shape} and {theirs}), "
                "so they cannot be joined into one forward, which a strategy that shards parameters needs on "
                "every rank alike; pad them to one length, or drop batch.max_micro_batch_size"
            )

    def _joinable(self, batch: Any) -> Any:
        """The batch's layout, or None (and no joining from here on) when it cannot be joined."""
        try:
            return layout(batch)
        except NotConcatenable as why:
            # Every rank's batches have the same structure, so every rank stops joining here.
            self._concat = False
            if self.say is not None:
                self.say(
                    f"phalanx: batch.adaptive: the loader's batches hold {why}, which phalanx cannot join "
                    "into a larger batch; each forward stays one micro-batch (a step takes more of them)"
                )
            return None


def shard_loader(
    loader: DataLoader,
    *,
    train: bool,
    rank: int,
    world_size: int,
    batch_size: int,
    multiple_of: int,
    seed: int,
    device: torch.device,
    options: DataConfig,
    procs_per_node: int = 1,
) -> DeviceLoader:
    """Rebuild ``loader`` around a :class:`ShardedSampler`, keeping the user's dataset and collate,
    with the ``data`` section's loader settings (see docs/data.md).

    ``batch_size`` is per rank and per forward; ``multiple_of`` is what the global order is padded to
    (see :class:`ShardedSampler`); ``procs_per_node`` shares the CPUs for ``num_workers: auto``.
    """
    if isinstance(loader.dataset, IterableDataset):
        # An iterable dataset decides its own order, and its workers split the stream between
        # them: it is used as built (another worker count would change the data). Training cuts the
        # stream into global batches and keeps this rank's share (see runtime/shares.py).
        drop = options.drop_last or loader.drop_last
        stream = StreamShare(rank, world_size, multiple_of, batch_size, drop_last=drop) if train else None
        return DeviceLoader(
            loader,
            None,
            device,
            train=train,
            non_blocking=loader.pin_memory,
            prefetch_to_device=options.prefetch_to_device,
            stream=stream,
        )
    if loader.batch_size is None:
        raise PhalanxError(
            "phalanx shards DataLoaders built with batch_size=...; "
            "a custom batch_sampler cannot be split over processes"
        )
    shuffle = _shuffles(loader)
    split = presplit(loader)
    drop_last = train and (options.drop_last or loader.drop_last)
    if split is not None:
        seed, drop_last = split.seed, drop_last or split.drop_last
    sampler = ShardedSampler(
        len(loader.dataset),
        rank,
        world_size,
        shuffle=shuffle,
        seed=seed,
        multiple_of=multiple_of,
        drop_last=drop_last,
        chunk=batch_size if train else 1,  # training: micro-batches dealt out (docs/data.md)
    )
    if options.num_workers == "auto":
        workers = auto_workers(cpu_count(), procs_per_node)
    else:
        workers = loader.num_workers if options.num_workers is None else options.num_workers
    # Without workers the batches are built here, so one can be looked at (see pinning.py).
    peek = (lambda: first_batch(loader.dataset, loader.collate_fn, device)) if workers == 0 else None
    pin = choose_pin(options.pin_memory, device, peek)
    extra: dict[str, Any] = {"pin_memory_device": getattr(loader, "pin_memory_device", "")}
    if hasattr(loader, "in_order"):  # torch >= 2.6
        extra["in_order"] = loader.in_order
    if workers > 0:
        # Persistent workers are phalanx's default: the sampler runs in this process, so a new
        # epoch (set_epoch) or a resumed position reaches them without restarting them.
        persistent = True if options.persistent_workers is None else options.persistent_workers
        extra.update(prefetch_factor=options.prefetch_factor or loader.prefetch_factor, persistent_workers=persistent)
    rebuilt = DataLoader(
        loader.dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=pin,
        drop_last=False,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        **extra,
    )
    return DeviceLoader(
        rebuilt, sampler, device, train=train, non_blocking=pin, prefetch_to_device=options.prefetch_to_device
    )


def auto_workers(cpus: int, procs_per_node: int) -> int:
    """Loader workers per rank for ``data.num_workers: auto``: this node's usable cores shared by its
    ranks, less one for the rank's own process (which runs the training loop), at most
    :data:`MAX_AUTO_WORKERS`. 0 (load in the main process) when a rank has a core or less."""
    return max(0, min(MAX_AUTO_WORKERS, cpus // max(procs_per_node, 1) - 1))


def _shuffles(loader: DataLoader) -> bool:
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler_has_custom_num_samples(sampler):
            raise PhalanxError(
                "the DataLoader's RandomSampler draws with replacement or a custom num_samples, "
                "which phalanx cannot split over processes exactly; use shuffle=True without a custom sampler"
            )
        return True
    if isinstance(loader.sampler, (SequentialSampler, ShardedSampler)):
        return False
    split = presplit(loader)
    if split is not None:
        return split.shuffle
    raise PhalanxError(
        f"the DataLoader uses a {type(loader.sampler).__name__}, which phalanx cannot split over processes; "
        "build it with shuffle=True or shuffle=False and let phalanx shard it"
    )


def loader_roles(shuffling: list[bool], *, with_optimizer: bool, training_set_up: bool) -> list[bool]:
    """Which of one ``setup()`` call's DataLoaders train, given which of them shuffle (docs/session.md,
    "Training and evaluation loaders"): every shuffling one; and where none shuffles, the call holds
    an optimizer and no training loader is set up yet, the first (ordered data: a language model's
    text, a time series). The others evaluate."""
    if any(shuffling) or not shuffling or not with_optimizer or training_set_up:
        return list(shuffling)
    return [i == 0 for i in range(len(shuffling))]


def shuffles(loader: DataLoader) -> bool:
    split = presplit(loader)
    return isinstance(loader.sampler, RandomSampler) or (split is not None and split.shuffle)


def _batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor, else the length of its first list."""
    # The usual batch, a tensor or a tuple, list or dict whose first entry is one, without a walk
    # over the whole batch: this runs for every batch handed out.
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(first, dict) and first:
        first = next(iter(first.values()))
    if isinstance(first, torch.Tensor) and first.dim():
        return first.shape[0]
    return _walked_batch_len(batch)


def _walked_batch_len(batch: Any) -> int:
    """_batch_len over the whole batch, in map_tensors' order."""
    found: list[int] = []
    map_tensors(batch, lambda t: found.append(t.shape[0]) if t.dim() else None)
    if found:
        return found[0]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        if isinstance(value, (list, tuple)):
            return len(value)
    raise PhalanxError(
        f"cannot tell the batch size of a {type(batch).__name__} batch; "
        "batches should hold tensors or lists with one entry per sample"
    )
