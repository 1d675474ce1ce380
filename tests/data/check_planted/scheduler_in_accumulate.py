"""Planted: a scheduler stepped inside session.accumulate() that phalanx was not given."""

import torch

import phalanx

session = phalanx.Session()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1)))
model, optimizer, loader = session.setup(model, optimizer, loader)
for epoch in session.epochs():
    for x, y in session.progress(loader):
        with session.accumulate(model):
            session.backward(torch.nn.functional.mse_loss(model(x), y))
            scheduler.step()  # planted
session.save()
