"""Loading a plain-layout checkpoint on 2 gloo processes: each rank's private memory grows by the
optimizer state it keeps and no more, however large the files; before, every rank read both files
whole (N copies of the model and of every rank's optimizer state on an N-process node)."""

from __future__ import annotations

from pathlib import Path

import pytest

import phalanx
from tests.helpers.checkpoint_memory import load_measured, save_large

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self (Linux)"),
]
TIMEOUT = 240
MiB = 1 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("memory")
    return Path(phalanx.spawn(save_large, nprocs=2, args=(str(root / "ckpt"),), cpu=True, timeout=TIMEOUT)[0])


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_private_memory_of_a_load_is_what_the_rank_keeps(checkpoint, strategy):
    files = {name: (checkpoint / name).stat().st_size for name in ("model.pt", "optimizer.pt")}
    ranks = phalanx.spawn(load_measured, nprocs=2, args=(strategy, str(checkpoint)), cpu=True, timeout=TIMEOUT)
    sizes = ", ".join(f"{name} {size / MiB:.0f} MiB" for name, size in files.items())
    print(f"\n{strategy}: {sizes}")
    for rank, out in enumerate(ranks):
        print(
            f"  rank {rank}: keeps {out['held'] / MiB:.0f} MiB of optimizer state | mapped load: private "
            f"+{out['mapped']['peak_anon'] / MiB:.0f} MiB peak, +{out['mapped']['anon_after'] / MiB:.0f} MiB after, "
            f"resident +{out['mapped']['peak_rss'] / MiB:.0f} MiB peak (shared file pages included) | "
            f"files read whole (before): resident +{out['whole']['peak_rss'] / MiB:.0f} MiB peak, "
            f"private +{out['whole']['peak_anon'] / MiB:.0f} MiB peak sampled"
        )
    for out in ranks:
        # What a rank must hold after the load is its optimizer state (its parameters exist already);
        # 10% and 16 MiB for everything else a load allocates (hash buffers, the small files).
        bound = out["held"] * 1.1 + 16 * MiB
        assert out["mapped"]["peak_anon"] <= bound, (out, bound)
        # A plain read is all private (no file pages): VmHWM is its exact peak. It must break the
        # bound, or this test could not tell the two loads apart.
        assert out["whole"]["peak_rss"] > bound, (out, bound)
        assert out["mapped"]["peak_anon"] < out["whole"]["peak_rss"]
        assert out["left_mapped"] == [] and out["same_state"]
    if strategy == "zero1":  # each rank keeps its own half of the state
        assert all(out["held"] < 0.6 * files["optimizer.pt"] for out in ranks)
