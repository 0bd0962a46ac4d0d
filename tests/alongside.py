"""Training a wrapped model beside its single-process reference, one process."""


def step_alongside(pairs, x) -> None:
    """One training step of each (model, optimizer) pair on the same input
    (loss: the output's mean square): the wrapped model and its reference."""
    for model, opt in pairs:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
