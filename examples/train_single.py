"""A plain single-device training loop: the starting point. Compare with train_phalanx.py."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from phalanx.demo.digits import DigitsCNN, train_test_split  # only for the data and the model

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
train_set, test_set = train_test_split()
model = DigitsCNN().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
loader = DataLoader(train_set, batch_size=64, shuffle=True)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=5 * len(loader))

for epoch in range(5):
    model.train()
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        scheduler.step()
    print(f"epoch {epoch + 1} loss {loss.item():.4f}")

model.eval()
test_loader = DataLoader(test_set, batch_size=128)
correct = 0
with torch.no_grad():
    for images, labels in test_loader:
        correct += (model(images.to(device)).argmax(1) == labels.to(device)).sum().item()
print(f"test accuracy {correct / len(test_set):.4f}")
