"""`phalanx tune`'s micro-batch search under train.memory_cap on CUDA (the caching allocator's
fraction), so a trial hits a real CUDA out-of-memory and the search recovers from it.

The script trains an MLP whose activations dominate (4 layers of 2048, 17M parameters, about
40 KiB of saved activations per sample); its own micro-batch is 16384 samples (over 1 GiB with
the model state), under a cap of 768 MiB: that trial runs out of memory, a smaller one fits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from phalanx.tune.trials import OK, OOM
from phalanx.util.sizes import size_bytes
from tests.gpu.acceptance.report import Check

CAP = "768MiB"
WIDTH, GLOBAL_BATCH = 2048, 16384
TIMEOUT_S = 240

SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import phalanx


class Batched(Dataset):
    def __init__(self, length):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(1024, {width}, generator=g), torch.randint(0, 10, (1024,), generator=g)
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.x[i % 1024], self.y[i % 1024]

    def __getitems__(self, indices):
        at = torch.as_tensor(indices) % 1024
        return self.x[at], self.y[at]


session = phalanx.Session(train={{"epochs": 10_000}})
torch.manual_seed(0)
layers = []
for _ in range(4):
    layers += [nn.Linear({width}, {width}), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear({width}, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loader = DataLoader(Batched({length}), batch_size={batch}, shuffle=True, collate_fn=lambda batch: batch)
model, optimizer, loader = session.setup(model, optimizer, loader)
for epoch in session.epochs():
    for x, y in loader:
        with session.accumulate(model):
            session.backward(nn.functional.cross_entropy(model(x), y))
"""


def run_group(command: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """Run ``command`` in a process group of its own, so a timeout ends the launcher's workers too."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        err += f"\ngpu_check: phalanx tune did not finish within {TIMEOUT_S}s"
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def run() -> list[Check]:
    with tempfile.TemporaryDirectory(prefix="gpu-check-tune-") as tmp:
        root = Path(tmp)
        (root / "train.py").write_text(SCRIPT.format(width=WIDTH, length=4 * GLOBAL_BATCH, batch=GLOBAL_BATCH))
        (root / "phalanx.yaml").write_text("train:\n  seed: 0\n")
        command = [
            sys.executable,
            "-m",
            "phalanx",
            "tune",
            "--nproc",
            "1",
            "--memory-cap",
            CAP,
            "--steps",
            "4",
            "--warmup",
            "1",
            "--search",
            "micro-batch",
            "--dry-run",
            "--config",
            str(root / "phalanx.yaml"),
            "--run-dir",
            str(root / "runs"),
            "train.py",
        ]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
        done = run_group(command, root, env)
        found = list((root / "runs").glob("*-tune/tune.json"))
        document = json.loads(found[0].read_text()) if found else {"trials": []}
    trials = [(t["micro_batch_size"], t["outcome"], t.get("peak_mem_bytes")) for t in document["trials"]]
    chosen = [t for t in document["trials"] if t.get("chosen")]
    ooms = [size for size, outcome, _ in trials if outcome == OOM]
    fits = [size for size, outcome, _ in trials if outcome == OK]
    peak = chosen[0].get("peak_mem_bytes") if chosen else None
    ok = done.returncode == 0 and bool(ooms) and bool(fits) and peak is not None and peak <= size_bytes(CAP)
    tried = ", ".join(f"{size}: {outcome}" for size, outcome, _ in trials) or "no trial recorded"
    figure = f"exit {done.returncode}; trials {tried}"
    if chosen:
        figure += f"; chosen {chosen[0]['micro_batch_size']}, peak {peak / 2**20:.0f} MiB" if peak else "; no peak"
    if done.returncode != 0:
        figure += f"; {(done.stderr.strip().splitlines() or ['(no stderr)'])[-1][:200]}"
    return [
        Check(
            f"micro-batch search under a {CAP} cap",
            ok,
            figure,
            f"a trial out of memory, one that fits, tune exits 0, the chosen peak within {CAP}",
            {"trials": trials, "returncode": done.returncode, "chosen_peak_bytes": peak},
        )
    ]
