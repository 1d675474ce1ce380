"""Planted: the loss divided by the accumulation steps inside session.accumulate()."""

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
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss = loss / session.accumulation_steps  # planted
            session.backward(loss)
session.save()
