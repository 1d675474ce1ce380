"""The batch plan has one owner, session/batch_plan.py: no other module of src/phalanx holds a plan,
derives one, or drives what changes it (checked by walking the source, not trusted).

What counts as deriving or holding the plan outside the owner:

- calling ``plan_batch`` (config/batch.py's arithmetic, or a strategy's ``plan_batch``), except in
  strategies/base.py, where a strategy supplies its process count and micro-batch multiple to the
  arithmetic;
- building a ``BatchPlan``, except in config/batch.py (the arithmetic) and session/facts.py (which
  reads back the plan the Session wrote into session.json);
- setting an attribute named ``batch`` anywhere, or reading ``self.batch`` (a class keeping its own
  copy of the plan); ``config.batch`` (the settings) and ``session.batch`` (the read-only plan) are
  reads of other objects and stay allowed;
- building what the owner holds (``LayoutLock``, ``AdaptiveBatch``, ``NoiseProbe``, ``LRScaling``),
  or calling the methods that re-plan through them (``noise.plan``/``resize``,
  ``adaptive.plan``/``current``/``decide``, ``layout.check``/``declare``), or hooking
  ``adaptive.on_change``.

``test_each_rule_catches_its_case`` feeds every rule a snippet that breaks it, so that a walker that
stopped seeing a case fails here rather than passing silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"
OWNER = "session/batch_plan.py"
# Where a call or a construction is allowed besides the owner, and why (see the module docstring).
ALLOWED = {
    "plan_batch": {"strategies/base.py"},
    "BatchPlan": {"config/batch.py", "session/facts.py"},
}
HELD = {"LayoutLock", "AdaptiveBatch", "NoiseProbe", "LRScaling"}
REPLANNING = {"noise": {"plan", "resize"}, "adaptive": {"plan", "current", "decide"}, "layout": {"check", "declare"}}


def _name(node: ast.AST) -> str | None:
    """The last name of ``a.b.c`` or ``c``, without leading underscores (``self._noise`` is ``noise``)."""
    if isinstance(node, ast.Name):
        return node.id.lstrip("_")
    if isinstance(node, ast.Attribute):
        return node.attr.lstrip("_")
    return None


def violations(source: str, where: str) -> list[str]:
    """What ``source``, as the module at ``where`` (relative to src/phalanx), does to the plan
    that only the owner may do."""
    if where == OWNER:
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            called = _name(node.func)
            if called in ALLOWED and where not in ALLOWED[called]:
                found.append(f"{line} calls {called}()")
            elif called in HELD:
                found.append(f"{line} builds a {called}, which the batch owner holds")
            elif isinstance(node.func, ast.Attribute) and called in REPLANNING.get(_name(node.func.value), ()):
                found.append(f"{line} calls {_name(node.func.value)}.{called}(), which re-plans the batch")
        elif isinstance(node, ast.Attribute):
            if node.attr == "batch" and not isinstance(node.ctx, ast.Load):
                found.append(f"{line} sets .batch")
            elif node.attr == "batch" and isinstance(node.value, ast.Name) and node.value.id == "self":
                found.append(f"{line} reads self.batch, a copy of the plan")
            elif node.attr == "on_change" and not isinstance(node.ctx, ast.Load) and _name(node.value) == "adaptive":
                found.append(f"{line} hooks adaptive.on_change")
    return found


def test_no_module_but_the_owner_derives_or_holds_the_batch_plan():
    assert (SRC / OWNER).is_file()
    found = [
        v
        for path in sorted(SRC.rglob("*.py"))
        for v in violations(path.read_text(encoding="utf-8"), path.relative_to(SRC).as_posix())
    ]
    assert found == []


@pytest.mark.parametrize(
    "snippet",
    [
        "session.batch = plan",
        "self.batch: BatchPlan | None = None",
        "del session.batch",
        "print(self.batch.global_batch_size)",
        "strategy_cls.plan_batch(config, 2, 64)",
        "plan_batch(2, 64, None)",
        "BatchPlan(64, 32, 1, 2)",
        "self.noise.plan(plan)",
        "self._noise.resize(plan)",
        "session.adaptive.current()",
        "self.adaptive.decide(10, 5.0, True)",
        "layout.check(plan, None, planner)",
        "self.layout.declare('here')",
        "LayoutLock(config, None, {})",
        "AdaptiveBatch(config, topology)",
        "NoiseProbe(config, strategy, topology, [])",
        "runtime.lr.LRScaling('linear', 64, 32)",
        "self.adaptive.on_change = self.replan",
    ],
)
def test_each_rule_catches_its_case(snippet):
    assert len(violations(snippet, "launch/launcher.py")) == 1, snippet
    assert violations(snippet, OWNER) == []  # the same code is the owner's to write


@pytest.mark.parametrize(
    "snippet",
    [
        "config.batch.global_batch_size",
        "size = session.batch.micro_batch_size",
        "plan = facts.batch",
        "self.plan.processes",
        "plan = owner.plan_loader(8)",
        "session.noise.value",
        "estimate.big = plan.global_batch_size",
        "self.adaptive.k",
    ],
)
def test_reads_and_the_owners_own_surface_pass(snippet):
    assert violations(snippet, "launch/launcher.py") == []


def test_the_allowances_are_where_they_say():
    assert violations("plan_batch(2, 64, None)", "strategies/base.py") == []
    assert violations("BatchPlan(64, 32, 1, 2)", "session/facts.py") == []
    assert violations("BatchPlan(64, 32, 1, 2)", "strategies/base.py") != []


def test_the_session_s_plan_is_read_only():
    import phalanx

    session = phalanx.Session(batch={"global_batch_size": 8}, train={"progress": False})
    try:
        assert session.batch is not None and session.batch.global_batch_size == 8
        with pytest.raises(AttributeError):
            session.batch = None
    finally:
        session.close()
