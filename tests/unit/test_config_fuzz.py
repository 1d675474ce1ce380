"""Issue 15: random and mutated inputs to the config layer and the CLI flags, with a fixed seed.
Whatever comes in, the answer is a valid config (finite floats, 64-bit integers), or a ConfigError /
PhalanxError of one line, or argparse's exit 2: never another exception. No process starts:
`phalanx launch` is run only as far as prepare()."""

from __future__ import annotations

import contextlib
import io
import math
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.cli import launch_cmd
from phalanx.cli.main import main
from phalanx.config.loader import load_config
from phalanx.config.schema import Config
from phalanx.config.sections import INT64
from phalanx.errors import PhalanxError
from phalanx.launch import launcher
from phalanx.topology import LaunchContext

# No example database: each run tries the same examples, whatever earlier runs found.
FAST = settings(derandomize=True, database=None, max_examples=150, deadline=None)
FEW = settings(derandomize=True, database=None, max_examples=25, deadline=None)

KEYS = sorted(Config().flat())
# Paths go to the file system (the launcher's pre-flight creates and removes directories): from a
# fixed set in the test's directory only, never random text.
PATH_KEYS = {"checkpoint.dir", "launch.run_dir"}
SAFE_PATHS = ["runs", "new/deeper", "afile", "afile/sub", "x.py", ".", "'2024'", ""]

NON_FINITE = [".inf", "-.inf", ".nan", "nan", "inf", "-inf", "1e400", "-1e400", "1.0e+400", "NaN", ".Inf"]
HUGE = [str(10**30), str(-(10**30)), str(2**63), str(-(2**63) - 1), "1" + "0" * 400, str(2**63 - 1), "1e30"]

texts = st.text(max_size=30)
scalars = st.one_of(
    st.sampled_from(NON_FINITE + HUGE),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "null", "", "auto", "all", "0", "1", "[]", "[0, 1]", "{a: 1}", "'0,2'"]),
    texts,
)


def set_line(keys: list[str]) -> st.SearchStrategy[str]:
    known = st.sampled_from(keys)
    unknown = st.one_of(
        texts, st.sampled_from(keys).map(lambda k: k + ".x"), st.sampled_from(keys).map(lambda k: k.rpartition(".")[0])
    )
    return st.tuples(st.one_of(known, known, unknown), st.sampled_from(["=", "=", "", "=="]), scalars).map(
        lambda kv: f"{kv[0]}{kv[1]}{kv[2]}"
    )


def assert_valid(config: Config) -> None:
    """A config that came back is one the schema stands by: validating it again changes nothing."""
    again = Config.model_validate(config.model_dump())
    assert again.flat() == config.flat()
    for key, value in config.flat().items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float):
                assert math.isfinite(item), key
            if isinstance(item, int):
                assert INT64[0] <= item <= INT64[1], key


def one_line(err: Exception) -> None:
    assert str(err) and "\n" not in str(err), repr(err)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory without phalanx.yaml, with the inputs the CLI cases name; the tests run in it."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "x.py").write_text("print('not run')\n")
    (root / "bad.py").write_text("def f(:\n")
    (root / "afile").write_text("")
    (root / "good.yaml").write_text("train:\n  epochs: 2\n")
    (root / "broken.yaml").write_text("train: [\n")
    (root / "list.toml").write_text("a = [1, 2]\n")
    old = os.getcwd()
    os.chdir(root)
    try:
        yield root
    finally:
        os.chdir(old)


# -- (a) --set lines -------------------------------------------------------------------------------


@FAST
@given(st.lists(set_line(KEYS), min_size=1, max_size=4))
def test_set_lines(workdir, lines):
    try:
        config = load_config(overrides=lines, context=LaunchContext(), cwd=workdir)
    except PhalanxError as err:  # ConfigError included
        one_line(err)
    else:
        assert_valid(config)


@FAST
@given(st.sampled_from(KEYS), st.sampled_from(NON_FINITE + HUGE[:-2]))
def test_non_finite_and_huge_numbers_never_pass(workdir, key, text):
    try:
        config = load_config(overrides=[f"{key}={text}"], context=LaunchContext(), cwd=workdir)
    except PhalanxError as err:
        one_line(err)
        assert key in str(err)
    else:  # a text setting takes the text as it is; a float one, 10**30 (a finite float)
        assert_valid(config)
        assert text not in NON_FINITE or isinstance(config.flat()[key], str), (key, config.flat()[key])


# -- (b) config files ------------------------------------------------------------------------------

SECTION_NAMES = sorted({key.split(".")[0] for key in KEYS} | {key.rpartition(".")[0] for key in KEYS})
leaf_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
    st.sampled_from(["auto", "ddp", "fsdp", "bf16", "30m", "2GiB", "0,1", "steps=1:3"]),
)
trees = st.recursive(
    leaf_values,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(
            st.one_of(st.sampled_from(SECTION_NAMES + [k.rpartition(".")[2] for k in KEYS]), texts),
            children,
            max_size=4,
        ),
    ),  # fmt: skip
    max_leaves=12,
)


def _put(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def load_text(workdir: Path, name: str, text: str | bytes) -> None:
    path = workdir / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    try:
        config = load_config(path, context=LaunchContext())
    except PhalanxError as err:
        one_line(err)
    else:
        assert_valid(config)


@FAST
@given(trees)
def test_random_yaml_files(workdir, tree):
    load_text(workdir, "random.yaml", yaml.safe_dump(tree, allow_unicode=True))


@FAST
@given(st.dictionaries(st.sampled_from(KEYS), leaf_values, min_size=1, max_size=5))
def test_mutated_valid_configs(workdir, changes):
    tree = Config().model_dump()
    for key, value in changes.items():
        _put(tree, key, value)
    load_text(workdir, "mutated.yaml", yaml.safe_dump(tree, allow_unicode=True))


VALID_YAML = yaml.safe_dump(Config().model_dump())
VALID_TOML = '[strategy]\nname = "ddp"\n[strategy.ddp]\nbucket_cap_mb = 50.0\n[faults]\nhang_timeout = 10.0\n'


@FAST
@given(
    st.sampled_from([("c.yaml", VALID_YAML), ("c.toml", VALID_TOML)]),
    st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 20), st.binary(max_size=8)), min_size=1, max_size=4),
)
def test_byte_mutations_of_valid_files(workdir, file, edits):
    name, text = file
    data = bytearray(text.encode())
    for at, cut, insert in edits:
        at = at % (len(data) + 1)
        data[at : at + cut] = insert
    load_text(workdir, name, bytes(data))


@pytest.mark.parametrize("opener", ["[", "{a: ", "- "])
def test_deeply_nested_files(workdir, opener):
    for depth in (150, 3000):  # within the parser's recursion, and past it
        load_text(workdir, "deep.yaml", opener * depth)
        load_text(workdir, "deep.toml", "a = " + "[" * depth)


# -- (c) CLI flags ---------------------------------------------------------------------------------

numbers = st.one_of(
    st.sampled_from(NON_FINITE + HUGE + ["0", "-1", "1", "2", "8", "0.5", "1e9", "7.5e9", "-0.0"]),
    st.integers(-(2**40), 2**40).map(str),
    st.floats().map(repr),
    st.text(max_size=6),
)
# Mostly values a user would type, so that many runs get past argparse to phalanx's own checks.
counts = st.one_of(st.integers(-2, 8).map(str), st.integers(-2, 8).map(str), numbers)
sizes = st.one_of(st.floats(0.001, 1e13).map(repr), st.sampled_from(["1e9", "80", "0.5"]), numbers)


def run_cli(argv: list[str]) -> None:
    """``phalanx ARGV`` in this process: exit 0, or 2 with one ``phalanx: error:`` line."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as stop:  # argparse
        code = stop.code
    assert code in (0, 2), (argv, code, err.getvalue())
    if code == 2:
        lines = err.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith("phalanx: error: "), (argv, err.getvalue())
    assert "Traceback" not in out.getvalue() + err.getvalue()


def flags(options: dict[str, st.SearchStrategy[str]]) -> st.SearchStrategy[list[str]]:
    """Some of ``options``, each with a value drawn for it (a strategy of None: a switch)."""
    chosen = st.lists(st.sampled_from(sorted(options)), unique=True, max_size=3)

    def values(names: list[str]) -> st.SearchStrategy[list[str]]:
        parts = [options[n].map(lambda v, n=n: [n, v]) if options[n] is not None else st.just([n]) for n in names]
        return st.tuples(*parts).map(lambda groups: [item for group in groups for item in group])

    return chosen.flatmap(values)


PLAN_FLAGS = {
    "--micro-batch": counts,
    "--devices": counts,
    "--device-memory": sizes,
    "--precision": st.sampled_from(["fp32", "bf16", "fp16", "fp8"]),
    "--optimizer": st.sampled_from(["sgd", "momentum", "adam", "lion"]),
    "--accounting": st.sampled_from(["phalanx", "zero-paper"]),
    "--json": None,
}


@FAST
@given(sizes, flags(PLAN_FLAGS))
def test_plan_flags(workdir, params, rest):
    run_cli(["plan", "--params", params, *rest])


@FEW
@given(st.sampled_from(["digits", "gpt"]), flags({k: v for k, v in PLAN_FLAGS.items() if k != "--micro-batch"}))
def test_plan_flags_with_a_model(workdir, example, rest):
    run_cli(["plan", "--example", example, *rest])


hostports = st.one_of(
    st.tuples(
        st.sampled_from(["node01", "127.0.0.1", "[::1]", "", "h"]), st.sampled_from([":", "", "::"]), numbers
    ).map("".join),
    texts,
)
LAUNCH_FLAGS = {
    "--nproc": counts,
    "--gpus": st.one_of(st.sampled_from(["0", "0,1", "1,1", "-1", "a,b", "", ",", "0,", "99"]), texts),
    "--ranks": st.sampled_from(["0", "all", "1"]),
    "--run-dir": st.sampled_from(SAFE_PATHS),
    "--verbose": None,
    "--max-restarts": counts,
    "--nnodes": counts,
    "--node-rank": counts,
    "--master": hostports,
    "--rdzv-endpoint": hostports,
    "--rdzv-id": texts,
    "--profile": st.one_of(st.sampled_from(["steps=1:3", "steps=0:1", "steps=5:2", "steps=" + "9" * 30 + ":1"]), texts),
    # ASCII: phalanx.metrics.profile.parse_ranks takes '²' for a digit (see the helper's report).
    "--profile-ranks": st.one_of(st.sampled_from(["0", "0,1", "-1", "a"]), st.text("0123456789,- a", max_size=8)),
    "--config": st.sampled_from(["good.yaml", "broken.yaml", "list.toml", "missing.yaml", "afile", "."]),
    "--set": st.one_of(
        set_line([k for k in KEYS if k not in PATH_KEYS]),
        st.tuples(st.sampled_from(sorted(PATH_KEYS)), st.sampled_from(SAFE_PATHS)).map("=".join),
    ),
}


@pytest.fixture(scope="module")
def prepare_only():
    """`phalanx launch` stops after prepare(): a launch that passes it returns 0, and none starts."""

    def launch(request):
        launcher.prepare(request)
        return 0

    def no_workers(plan):
        raise AssertionError("a worker was about to start")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch_cmd, "launch", launch)
        mp.setattr(launcher, "run_workers", no_workers)
        yield


@FAST
@given(st.sampled_from(["x.py"] * 6 + ["bad.py", "missing.py", "afile"]), flags(LAUNCH_FLAGS))
def test_launch_flags(workdir, prepare_only, script, options):
    before = sorted(p.name for p in workdir.iterdir())
    run_cli(["launch", "--cpu", *options, script, "--script-arg"])
    assert sorted(p.name for p in workdir.iterdir()) == before  # the pre-flight leaves nothing behind
