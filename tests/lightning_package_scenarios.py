"""The process side of tests/test_lightning_packages.py: ZeroExtStrategy on
one Lightning package, `lightning.pytorch` or the standalone
`pytorch_lightning` (the same code under two names; zero_ext builds the
strategy on either's bases), on one rank.

    python tests/lightning_package_scenarios.py PACKAGE OUT_DIR

Imports PACKAGE before zero_ext.integrations.lightning (as a script on
pytorch_lightning does), then records: the strategy class the package's
registry gives for strategy="zero_ext", its name, base and pickled name;
the refusal of a mixed-precision flag; a fit by strategy="zero_ext" (stage 2:
accumulation, clipping by norm) against the same loop written with torch
alone; and the fitted model's checkpoint validated into a fresh module.
Writes OUT_DIR/<PACKAGE>.pt, read back with torch.load(weights_only=True).
"""
import importlib
import os
import pickle
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

PACKAGE, OUT_DIR = sys.argv[1], sys.argv[2]
pl = importlib.import_module(PACKAGE)

import zero_ext  # noqa: E402
from zero_ext.integrations import lightning as zero_ext_lightning  # noqa: E402

STEPS = 4
ACCUMULATE = 2
CLIP = 0.05  # below the gradient norm: every step clips


def batches(count: int) -> DataLoader:
    """`count` batches of 4, in a fixed order."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(4 * count, 6, generator=generator)
    samples = TensorDataset(x, torch.randn(4 * count, 1, generator=generator))
    return DataLoader(samples, batch_size=4)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def trainer(**options):
    # use_distributed_sampler=False: the batches in their order, as the hand-written loop takes them.
    return pl.Trainer(accelerator="cpu", devices=1, strategy="zero_ext", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                      **options)


def hand_written_weights(clip: bool = True):
    """The fit below, with torch alone."""
    torch.manual_seed(0)
    net = Net()
    optimizer = net.configure_optimizers()
    for index, (x, y) in enumerate(batches(STEPS * ACCUMULATE)):
        (F.mse_loss(net(x), y) / ACCUMULATE).backward()
        if (index + 1) % ACCUMULATE == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def main() -> dict:
    strategy_class = pl.strategies.StrategyRegistry["zero_ext"]["strategy"]
    result = {
        "registered": strategy_class.__name__,
        "module": strategy_class.__module__,
        "is_strategy_class": strategy_class is zero_ext_lightning.strategy_class(PACKAGE),
        "is_ddp": issubclass(strategy_class, pl.strategies.DDPStrategy),
        "pickled": type(pickle.loads(pickle.dumps(strategy_class(stage=3)))).__name__,
    }
    try:
        trainer(precision="bf16-mixed")
        result["bf16_mixed"] = "no error"
    except ValueError as error:
        result["bf16_mixed"] = str(error)

    torch.manual_seed(0)
    net = Net()
    fitting = trainer(max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP)
    fitting.fit(net, train_dataloaders=batches(STEPS * ACCUMULATE))
    result["strategy"] = type(fitting.strategy).__name__
    result["precision"] = type(fitting.strategy.precision_plugin).__name__
    result["weights"] = zero_ext.full_state_dict(net)
    result["hand_written"] = hand_written_weights()
    result["hand_written_unclipped"] = hand_written_weights(clip=False)

    path = os.path.join(OUT_DIR, f"{PACKAGE}.ckpt")
    fitting.save_checkpoint(path)
    validation = batches(2)
    result["trained_val_loss"] = fitting.validate(net, validation, verbose=False)[0]["val_loss"]
    result["restored_val_loss"] = trainer().validate(Net(), validation, ckpt_path=path, verbose=False)[0]["val_loss"]
    return result


if __name__ == "__main__":
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.save(main(), os.path.join(OUT_DIR, f"{PACKAGE}.pt"))
