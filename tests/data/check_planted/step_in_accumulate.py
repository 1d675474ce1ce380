"""Planted: optimizer.step() inside session.accumulate(), whose end steps already."""

import torch

import phalanx

session = phalanx.Session()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1)))
model, optimizer, loader = session.setup(model, optimizer, loader)
for epoch in session.epochs():
    for x, y in session.progress(loader):
        with session.accumulate(model):
            session.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()  # planted
session.save()
