"""zero_ext as a Lightning strategy.

    import lightning as L
    from zero_ext.integrations.lightning import ZeroExtStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroExtStrategy(stage=3),
                        accumulate_grad_batches=4, gradient_clip_val=1.0)
    trainer.fit(module)                      # under torchrun, or Lightning starts the ranks
    trainer.fit(module, ckpt_path=path)      # resume, at any world size or stage

Importing this module registers the strategy as "zero_ext" in Lightning's
StrategyRegistry, so ``Trainer(strategy="zero_ext")`` (stage 2) works too.
Built on ``lightning.pytorch`` (on the standalone ``pytorch_lightning`` where
only that is installed; with neither, the import raises ModuleNotFoundError
naming the install). ``strategy_class("pytorch_lightning")`` builds the same
for ``pytorch_lightning`` beside it (and registers it there; this happens at
import when pytorch_lightning is already imported). The methods are written
once, for either package, in _lightning_strategy.py.

What it changes in Lightning's DDPStrategy, and why:
  - setup_optimizers: once Lightning has built the optimizers (and their LR
    schedulers) from configure_optimizers, the LightningModule and the
    optimizer (or the list of them: Muon + AdamW under manual optimization)
    are wrapped by zero_ext.wrap. The optimizers stay the same objects, so
    the schedulers stay attached. Nothing is wrapped in DDP.
  - training_step and the other steps are called as DDPStrategy calls them
    without its wrapper: directly. zero_ext's hooks act on the module's
    forward (self(x)) and on its submodules' forwards, exactly as in a plain
    zero_ext loop. (Running the whole step as the module's forward, as
    Lightning does for FSDP, would cast the targets to the compute dtype and,
    with fp16, scale the loss twice: once at self(x), once at the step.)
    Stage 3 gathers parameters the module owns directly, not through a
    submodule, in its forward only; a step that uses them outside self(...)
    gets zero_ext's error naming zero_ext.full_params.
  - block_backward_sync (the micro-batches before the last of an
    accumulate_grad_batches step) is the module's no_sync().
  - Clipping (gradient_clip_val, or self.clip_gradients) goes through
    ZeroExtPrecision: by norm through optimizer.clip_grad_norm_, the global
    norm over every rank's shards (torch.nn.utils.clip_grad_norm_, Lightning's
    default, sees only this rank's shards in stages 1-3).
  - Precision: only Trainer(precision="32-true"). Lightning's mixed
    precision (autocast, and a GradScaler for "16-mixed") is refused: pass
    ZeroExtStrategy(mixed_precision="bf16" | "fp16") instead.
  - Checkpoints are directories written by zero_ext.save on every rank: each
    rank's shards of the model and optimizer, and Lightning's own state
    (loops, callbacks, LR schedulers, epoch, step) as the checkpoint's
    `extra`, which zero_ext.load reads back with torch.load(weights_only=True).
    fit(ckpt_path=...) loads them once the model is wrapped (zero_ext.load);
    validate/test/predict(ckpt_path=...) load the full weights.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Dict, Tuple

from ._lightning_strategy import LIGHTNING_STATE_KEY, LightningNames, PrecisionMethods, StrategyMethods

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _import_lightning() -> ModuleType:
    """`lightning.pytorch`, else the standalone `pytorch_lightning`."""
    failures = []
    for package in _PACKAGES:
        try:
            return importlib.import_module(package)
        except ImportError as error:
            failures.append(f"{package}: {error}")
    raise ModuleNotFoundError(
        "zero_ext.integrations.lightning needs Lightning, and neither lightning.pytorch nor pytorch_lightning "
        f"imports ({'; '.join(failures)}). Install it with `pip install lightning` (or the standalone "
        "`pip install pytorch-lightning`); the rest of zero_ext works without it.", name="lightning")


_pl = _import_lightning()  # the package ZeroExtStrategy is built on
_PL_NAMES = LightningNames(_pl)


class ZeroExtPrecision(PrecisionMethods, _pl.plugins.precision.Precision):
    """Lightning's full precision ("32-true"), with gradient clipping
    that reads zero_ext's gradients where they live: sharded across the
    ranks in stages 1-3."""

    _lightning = _PL_NAMES


class ZeroExtStrategy(StrategyMethods, _pl.strategies.DDPStrategy):
    """Lightning data parallelism through zero_ext instead of DDP.

    Args:
        stage: 0 replicated (like DDP), 1 sharded optimizer state,
            2 also sharded gradients, 3 also sharded parameters.
        mixed_precision, offload_optimizer, units, bucket_mb, prefetch,
            skip_nonfinite, offload_params, offload_path (keyword only):
            as zero_ext.wrap.
        timeout: bound on every collective wait (seconds or timedelta),
            zero_ext's and the process group's Lightning creates;
            default Lightning's (30 minutes).
        accelerator, parallel_devices, cluster_environment,
            checkpoint_io, precision_plugin, process_group_backend,
            start_method: as DDPStrategy. checkpoint_io is used only to
            read plain checkpoint files for validate/test/predict and to
            remove checkpoints; zero_ext.save writes them.

    zero_ext always reduces over the world group. configure_optimizers
    returns one optimizer, or several over disjoint parameters (Lightning
    steps several under manual optimization only).
    """

    _lightning = _PL_NAMES
    _precision_class = ZeroExtPrecision


def _class_like(like: type, prefix: str, bases: Tuple[type, ...], **attributes: object) -> type:
    """A class as `like`, on other bases, named prefix + its name in this
    module: importable, so it pickles (Lightning's spawn launcher does)."""
    name = prefix + like.__name__
    cls = type(like)(name, bases, dict(attributes, __module__=__name__, __qualname__=name, __doc__=like.__doc__))
    globals()[name] = cls
    return cls


def _classes_on(pl: ModuleType, prefix: str) -> Tuple[type, type]:
    """ZeroExtStrategy and ZeroExtPrecision on another Lightning package's
    bases: the same methods, that package's classes in their checks."""
    names = LightningNames(pl)
    precision = _class_like(ZeroExtPrecision, prefix, (PrecisionMethods, names.Precision), _lightning=names)
    strategy = _class_like(ZeroExtStrategy, prefix, (StrategyMethods, names.DDPStrategy), _lightning=names,
                           _precision_class=precision)
    return strategy, precision


_defined: Dict[str, Tuple[type, type]] = {_pl.__name__: (ZeroExtStrategy, ZeroExtPrecision)}


def strategy_class(package: str = "lightning.pytorch") -> type:
    """ZeroExtStrategy for `package`: "lightning.pytorch" (the `lightning`
    package) or "pytorch_lightning"; registers it there as "zero_ext"."""
    if package not in _PACKAGES:
        raise ValueError(f"strategy_class: package must be 'lightning.pytorch' or 'pytorch_lightning', got {package!r}")
    if package not in _defined:
        strategy, precision = _classes_on(importlib.import_module(package), "PytorchLightning")
        strategy.register_strategies(strategy._lightning.StrategyRegistry)
        _defined[package] = strategy, precision
    return _defined[package][0]


ZeroExtStrategy.register_strategies(_PL_NAMES.StrategyRegistry)
if "pytorch_lightning" in sys.modules:
    strategy_class("pytorch_lightning")  # `strategy="zero_ext"` there too

__all__ = ["LIGHTNING_STATE_KEY", "ZeroExtPrecision", "ZeroExtStrategy", "strategy_class"]
