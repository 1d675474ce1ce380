"""train_single.py on every device: `phalanx launch examples/train_phalanx.py`.

Changed lines are marked with `# phalanx`.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import phalanx  # phalanx
from phalanx.demo.digits import DigitsCNN, train_test_split  # only for the data and the model

session = phalanx.Session(train={"epochs": 5})  # phalanx: seeds every rank, joins the process group
train_set, test_set = train_test_split()
model = DigitsCNN()  # phalanx: no .to(device), setup() places it
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
loader = DataLoader(train_set, batch_size=64, shuffle=True)  # 64 stays the global batch
test_loader = DataLoader(test_set, batch_size=128)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=5 * len(loader))
model, optimizer, loader, test_loader, scheduler = session.setup(
    model, optimizer, loader, test_loader, scheduler
)  # phalanx

for epoch in session.epochs():  # phalanx
    model.train()
    for images, labels in session.progress(loader):  # phalanx: batches arrive on the device
        with session.accumulate(model):  # phalanx: steps, schedules and zeroes once per global batch
            loss = F.cross_entropy(model(images), labels)
            session.backward(loss)  # phalanx
    session.print(f"epoch {epoch + 1} loss {loss.item():.4f}")  # phalanx: rank 0 only

model.eval()
correct = []
with torch.no_grad():
    for images, labels in test_loader:
        correct.append(session.gather_for_metrics((model(images).argmax(1) == labels).float()))  # phalanx
session.print(f"test accuracy {torch.cat(correct).mean().item():.4f}")  # phalanx
