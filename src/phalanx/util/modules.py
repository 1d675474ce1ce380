"""Walking a model's modules: by class name (for settings that list classes), and who holds each parameter."""

from __future__ import annotations

from typing import Iterator

from torch import nn

from phalanx.errors import ConfigError


def post_order(module: nn.Module) -> Iterator[nn.Module]:
    """Every submodule, children before their parents (innermost first)."""
    for child in module.children():
        yield from post_order(child)
    yield module


def submodules_of(model: nn.Module, class_names: list[str], setting: str) -> list[nn.Module]:
    """The model's submodules (not the model itself) of the listed classes, innermost first;
    ``setting`` names the list in the error raised when none exists."""
    found = [m for m in post_order(model) if type(m).__name__ in class_names and m is not model]
    if not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            f"{setting} names {', '.join(class_names)}, but the model has no such submodule; "
            f"its module classes are: {', '.join(present)}"
        )
    return found


def parameter_holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every module that registers each parameter (by id), with the name it has there: a tied
    weight (an embedding shared with the output layer) has several holders."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in {id(m): m for m in model.modules()}.values():
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(param), []).append((module, name))
    return holders
