"""Tensor parallelism's plan on a model written like Meta's llama/model.py (tests/helpers/llama_style.py),
resolved with no process group: the automatic plan finds its SwiGLU FeedForward (w1, w3 colwise,
w2 rowwise, in the order Meta defines them) and says it keeps attention whole; the model's own
RMSNorm class takes sequence_parallel; an attention that reshapes with the whole model's head
count is refused in one line that names the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.strategies.tp_plan import kept_whole_line, resolve, unpaired_lines
from tests.helpers import llama_style as ls


def _refusal(model: nn.Module, tp: int, configured: dict) -> str:
    with pytest.raises(ConfigError) as excinfo:
        resolve(model, tp, configured)
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_the_automatic_plan_finds_metas_swiglu_and_keeps_attention_whole_with_a_line():
    model = ls.build()
    plan = resolve(model, 2, {})
    assert plan.styles == {
        f"layers.{i}.feed_forward.{w}": style
        for i in range(2)
        for w, style in (("w1", "colwise"), ("w3", "colwise"), ("w2", "rowwise"))
    }
    assert plan.kept_whole == ("layers.0.attention", "layers.1.attention")
    line = kept_whole_line(model, plan)
    assert line.startswith("phalanx: tp keeps attention 'layers.0.attention' and 1 more whole on every peer")
    assert "n_heads // tp_size, or -1" in line and "'layers.*.attention.wo': rowwise" in line


def test_a_models_own_rmsnorm_takes_sequence_parallel_and_a_batch_norm_does_not():
    model = ls.build()
    plan = resolve(model, 2, ls.FULL_PLAN)
    assert plan.styles["layers.1.ffn_norm"] == plan.styles["norm"] == "sequence_parallel"
    assert len(plan.split()) == 2 * 9 + 1
    # wk and wv give 16 features, which no rowwise layer takes: they feed the attention, whose wo does.
    assert unpaired_lines(model, plan, 2) == []

    class BatchNorm(nn.Module):  # its statistics span the batch: a slice of the sequence changes them
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

    class MatrixNorm(nn.Module):  # named like a norm, but not over the last dimension alone
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8, 8))

    for norm in (BatchNorm(), MatrixNorm(), nn.BatchNorm1d(8), nn.Linear(8, 8)):
        message = _refusal(nn.Sequential(norm), 2, {"0": "sequence_parallel"})
        assert "cannot take sequence_parallel: only a norm over the last dimension can" in message


def test_attention_reshaping_with_the_whole_head_count_is_refused_in_one_line():
    message = _refusal(ls.build("attribute"), 2, ls.FULL_PLAN)
    assert message.startswith(
        "strategy.tp.plan splits 'layers.0.attention' (MetaAttention) by heads over 2 peers, but its forward "
        "reshapes with self.n_local_heads = 4, the whole model's head count"
    ), message
    assert "n_heads // tp_size" in message and "-1" in message
    # The same model reshaping with -1 resolves; one whose count the attributes do not show is left
    # to the dry run of its first forward (tests/integration/test_tp_meta_llama.py).
    resolve(ls.build("-1"), 2, ls.FULL_PLAN)
    resolve(ls.build("args"), 2, ls.FULL_PLAN)
    # A head count the peers would split unevenly is refused by its own attribute: wk's 16 features
    # split evenly over 4 peers, its 2 key-value heads do not.
    message = _refusal(ls.build(), 4, {"layers.*.attention.w[qkv]": "colwise"})
    assert "its n_kv_heads = 2 does not divide by 4; set strategy.tp.size to a divisor of 2" in message
