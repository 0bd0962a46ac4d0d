"""The small model and training step the bad-input tests (test_errors.py,
test_errors_loose_inputs.py) share."""
import torch
import torch.nn as nn


def make(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(model, opt):
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()
