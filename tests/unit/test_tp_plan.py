"""Tensor parallelism's plan (strategies/tp_plan.py), resolved on small models built here, with no
process group: the automatic plan splits MLP pairs and keeps attention whole (and says so in one
line whose suggested plan resolves), a user's glob patterns win over it (later patterns over
earlier ones), a Hugging Face model's own base_model_tp_plan is used where the user gives none,
and everything a plan cannot do is one line naming the module and the fix."""

from __future__ import annotations

import ast
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.errors import ConfigError
from phalanx.strategies.tp_plan import kept_whole_line, resolve, split_parameters, unpaired_lines

DIM, HIDDEN = 8, 32


class GatedMLP(nn.Module):
    """Llama's MLP shape: gate and up d -> h, down h -> d, no biases."""

    def __init__(self, dim: int = DIM, hidden: int = 16):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SoftmaxMLP(nn.Module):
    """MLP-shaped, but its hidden step normalises over the hidden units: no peer can hold a slice."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.softmax(self.up(x), dim=-1))


class HeadAttention(nn.Module):
    """An attention of its own q, k, v, o layers that holds its head count."""

    def __init__(self, dim: int = DIM, heads: int = 2):
        super().__init__()
        self.num_heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))


class Block(nn.Module):
    def __init__(self, attention: str = "own", hidden: int = HIDDEN):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = HeadAttention() if attention == "own" else nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, hidden), nn.GELU(), nn.Linear(hidden, DIM))


class Net(nn.Module):
    def __init__(self, layers: int = 2, attention: str = "own", hidden: int = HIDDEN):
        super().__init__()
        self.embed = nn.Embedding(16, DIM)
        self.blocks = nn.ModuleList(Block(attention, hidden) for _ in range(layers))
        self.head = nn.Linear(DIM, 16, bias=False)


def _refusal(model: nn.Module, tp: int, configured=None, given=None) -> str:
    with pytest.raises(ConfigError) as excinfo:
        resolve(model, tp, configured or {}, given)
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# -- the automatic plan ---------------------------------------------------------------------


def test_the_automatic_plan_splits_a_sequential_mlp_up_colwise_and_down_rowwise():
    mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
    plan = resolve(mlp, 2, {})
    assert plan.styles == {"0": "colwise", "2": "rowwise"}
    assert plan.source.startswith("automatic") and plan.kept_whole == ()
    assert kept_whole_line(mlp, plan) is None
    # Colwise splits the up layer's weight and bias, rowwise the down layer's weight (its bias is whole).
    assert split_parameters(mlp, plan) == DIM * HIDDEN + HIDDEN + HIDDEN * DIM
    assert plan.describe() == "2 modules split (automatic: MLP blocks)"


def test_the_automatic_plan_splits_gate_and_up_colwise_and_down_rowwise():
    model = nn.Sequential()
    model.add_module("mlp", GatedMLP())
    plan = resolve(model, 4, {})
    assert plan.styles == {"mlp.gate": "colwise", "mlp.up": "colwise", "mlp.down": "rowwise"}
    assert split_parameters(model, plan) == 3 * DIM * 16


def test_an_mlp_whose_hidden_units_mix_is_kept_whole_and_said():
    model = nn.Sequential()
    model.add_module("mixing", SoftmaxMLP())
    model.add_module("mlp", nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)))
    plan = resolve(model, 2, {})
    assert set(plan.styles) == {"mlp.0", "mlp.2"} and plan.mixing == ("mixing",)
    alone = nn.Sequential()
    alone.add_module("mixing", SoftmaxMLP())
    message = _refusal(alone, 2)
    assert "'mixing' mixes its hidden units" in message and "\n" not in message


def test_a_split_of_a_tied_weight_is_refused_in_one_line():
    model = nn.Sequential(nn.Embedding(16, DIM), nn.Linear(DIM, 16, bias=False))
    model[1].weight = model[0].weight  # the output layer reads the embedding's table
    message = _refusal(model, 2, {"0": "rowwise"})
    assert "tied weight" in message and "'0'" in message and "'1'" in message and "\n" not in message


def test_what_is_not_an_mlp_pair_is_left_alone():
    # Linear d -> d pairs (hidden == dim), a block with a norm of its own, reversed shapes: none is an MLP.
    square = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))
    normed = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, DIM))
    mismatched = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(16, DIM))
    for model in (square, normed, mismatched):
        message = _refusal(model, 2)
        assert "found nothing" in message and "strategy.tp.plan" in message


@pytest.mark.parametrize("attention", ["own", "torch"])
def test_the_automatic_plan_keeps_attention_whole_and_says_so_in_one_line(attention):
    model = Net(attention=attention)
    plan = resolve(model, 2, {})
    assert plan.styles == {f"blocks.{i}.mlp.{j}": s for i in range(2) for j, s in (("0", "colwise"), ("2", "rowwise"))}
    assert plan.kept_whole == ("blocks.0.attn", "blocks.1.attn")
    assert not any(name.startswith("blocks.0.attn") for name in plan.styles)
    line = kept_whole_line(model, plan)
    assert line is not None and "\n" not in line
    assert line.startswith("phalanx: tp keeps attention 'blocks.0.attn' and 1 more whole on every peer")
    if attention == "torch":
        assert "nn.MultiheadAttention" in line
        return
    # The plan the line suggests for an attention of its own layers resolves, and splits them by heads.
    suggested = ast.literal_eval(re.sub(r": (\w+)", r": '\1'", re.search(r"strategy\.tp\.plan (\{.*\})", line)[1]))
    assert suggested == {
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.o": "rowwise",
    }
    split = resolve(model, 2, suggested)
    assert split.styles["blocks.1.attn.o"] == "rowwise" and len(split.styles) == 8


# -- the user's plan ------------------------------------------------------------------------


def test_user_globs_win_over_the_automatic_plan_and_later_patterns_win():
    model = Net()
    # GELU has no weight, but the glob matches it: colwise on it is refused ...
    assert "GELU" in _refusal(model, 2, {"blocks.*.mlp.*": "colwise"})
    # ... so name the layers. Later patterns win where two match one module.
    plan = resolve(
        model, 2, {"blocks.*.mlp.[02]": "colwise", "blocks.1.mlp.2": "rowwise", "blocks.0.mlp.2": "replicate"}
    )
    assert plan.source == "strategy.tp.plan" and plan.kept_whole == ()  # the user's plan is all there is
    assert plan.styles == {
        "blocks.0.mlp.0": "colwise",
        "blocks.0.mlp.2": "replicate",
        "blocks.1.mlp.0": "colwise",
        "blocks.1.mlp.2": "rowwise",
    }
    assert set(plan.split()) == {"blocks.0.mlp.0", "blocks.1.mlp.0", "blocks.1.mlp.2"}
    assert split_parameters(model, plan) == 2 * (DIM * HIDDEN + HIDDEN) + HIDDEN * DIM  # replicate splits nothing
    # The same two patterns the other way round: the broad one, given last, wins.
    plan = resolve(model, 2, {"blocks.1.mlp.2": "rowwise", "blocks.*.mlp.[02]": "colwise"})
    assert plan.styles["blocks.1.mlp.2"] == "colwise"


def test_a_colwise_layer_no_rowwise_layer_takes_is_said_in_one_line():
    model = Net()
    paired = resolve(model, 2, {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"})
    assert unpaired_lines(model, paired, 2) == []
    alone = resolve(model, 2, {"blocks.*.mlp.0": "colwise"})  # its output would stay a slice per peer
    lines = unpaired_lines(model, alone, 2)
    assert len(lines) == 2 and all("\n" not in line and "1/2" in line for line in lines)
    assert "'blocks.0.mlp.0'" in lines[0] and "set_tp_plan" in lines[0]


def test_a_plan_given_in_python_wins_over_the_configs_and_takes_parallel_styles():
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = Net()
    plan = resolve(model, 2, {"blocks.*.mlp.0": "colwise"}, {"head": ColwiseParallel(), "embed": "rowwise"})
    assert plan.source == "the plan given to setup()" and set(plan.styles) == {"head", "embed"}
    # A ParallelStyle of the user's own: every parameter of its module counts as split.
    assert split_parameters(model, plan) == DIM * 16 + 16 * DIM


def test_norms_take_sequence_parallel():
    model = Net()
    plan = resolve(model, 2, {"blocks.*.norm": "sequence_parallel", "blocks.*.mlp.0": "colwise"})
    assert plan.styles["blocks.1.norm"] == "sequence_parallel"
    assert split_parameters(model, plan) == 2 * (DIM * HIDDEN + HIDDEN)  # a norm's parameters are whole


def test_a_pattern_matching_nothing_is_one_line_naming_it():
    model = Net()
    message = _refusal(model, 2, {"blocks.*.mlp.0": "colwise", "layers.*.mlp.0": "colwise"})
    assert "'layers.*.mlp.0'" in message and "strategy.tp.plan" in message and "named_modules" in message
    assert "blocks.0.mlp.0" in message  # the modules of that name, as a hint
    given = _refusal(model, 2, given={"decoder.*": "colwise"})
    assert "'decoder.*'" in given and "the plan given to setup()" in given


def test_a_style_that_is_no_style_is_refused():
    message = _refusal(Net(), 2, given={"blocks.*.mlp.0": "colwize"})
    assert "colwize" in message and "colwise, rowwise, sequence_parallel, replicate" in message


@pytest.mark.parametrize(
    "pattern, style, words",
    [
        ("blocks.0.norm", "colwise", "'blocks.0.norm' (LayerNorm) cannot be split colwise"),
        ("blocks.0.attn", "rowwise", "'blocks.0.attn' (HeadAttention) cannot be split rowwise"),
        ("blocks.0.mlp.0", "sequence_parallel", "'blocks.0.mlp.0' (Linear) cannot take sequence_parallel"),
    ],
)
def test_a_style_a_module_cannot_take_is_refused(pattern, style, words):
    message = _refusal(Net(), 2, {pattern: style})
    assert words in message and "strategy.tp.plan" in message


@pytest.mark.parametrize(
    "tp, configured, words",
    [
        (4, {"blocks.*.mlp.0": "colwise"}, "'blocks.0.mlp.0' (Linear) has 30 output features"),
        (4, {"blocks.*.mlp.2": "rowwise"}, "'blocks.0.mlp.2' (Linear) has 30 input features"),
        (3, {"embed": "colwise"}, "'embed' (Embedding) has 8 embedding width"),
        (3, {"embed": "rowwise"}, "'embed' (Embedding) has 16 vocabulary rows"),
        (4, {}, "'blocks.0.mlp.0' (Linear) has 30 output features"),  # the automatic plan checks too
    ],
)
def test_sizes_the_peers_would_split_unevenly_are_refused(tp, configured, words):
    message = _refusal(Net(hidden=30), tp, configured)
    assert words in message and f"{tp} tensor-parallel peers" in message and "strategy.tp.size" in message
    resolve(Net(hidden=32), 2, configured)  # even sizes resolve


# -- a Hugging Face model's own plan ----------------------------------------------------------


def _llama(**sizes):
    pytest.importorskip("transformers")
    from tests.helpers.hf_models import quiet

    quiet()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**{**config, **sizes}))


def test_a_hugging_face_model_brings_its_own_plan():
    model = _llama()
    plan = resolve(model, 2, {})
    assert plan.source == "LlamaForCausalLM's own tp_plan" and plan.kept_whole == ()
    layer = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise"}
    layer |= {"self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise"}
    layer |= {"mlp.down_proj": "rowwise"}
    assert plan.styles == {f"model.layers.{i}.{name}": s for i in range(2) for name, s in layer.items()}
    # Without biases: every split layer's weight, 4 of 32 x 32 and 3 of 32 x 64 per layer.
    assert split_parameters(model, plan) == 2 * (4 * 32 * 32 + 3 * 32 * 64)
    # The user's plan wins over the model's.
    mine = resolve(model, 2, {"model.layers.*.mlp.up_proj": "colwise"})
    assert mine.source == "strategy.tp.plan" and len(mine.styles) == 2


@pytest.mark.parametrize(
    "sizes, words",
    [
        ({"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}, "3 num attention heads"),
        ({"num_attention_heads": 4, "num_key_value_heads": 1}, "1 num key value heads"),
    ],
)
def test_head_counts_the_peers_cannot_divide_are_refused(sizes, words):
    model = _llama(**sizes)
    message = _refusal(model, 2)
    assert words in message and "2 tensor-parallel peers" in message and "strategy.tp.size" in message
    # Layer sizes alone would split evenly: the head count is what refuses.
    assert all(m.out_features % 2 == 0 for m in model.modules() if isinstance(m, nn.Linear))
    # A plan that leaves attention whole needs no head to divide.
    resolve(model, 2, {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"})


def test_attention_named_attention_checks_its_heads_too():
    # BERT's attention is "attention.self.query": 48 features split evenly, 3 heads do not.
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=32, hidden_size=48, num_hidden_layers=1, num_attention_heads=3, intermediate_size=64)
    model = BertModel(config)
    assert "3 num attention heads" in _refusal(model, 2, {"encoder.layer.*.attention.self.query": "colwise"})
    resolve(model, 3, {"encoder.layer.*.attention.self.query": "colwise"})
