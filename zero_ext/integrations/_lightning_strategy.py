"""ZeroExtStrategy's and ZeroExtPrecision's methods, written once for either
Lightning package.

`lightning.pytorch` and the standalone `pytorch_lightning` ship the same code
under two names, so a strategy for each needs that package's DDPStrategy as
its base and that package's classes in its checks. The methods live here, in
mixins that import no Lightning; zero_ext.integrations.lightning puts them on
a package's bases and gives them its `LightningNames`. What the strategy
changes in DDPStrategy, and why, is that module's docstring.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import tempfile
from types import ModuleType
from typing import Any, Callable, Dict, Generator, List, Optional, Tuple, Union

import torch

from ..files import load as zero_ext_load
from ..files import save as zero_ext_save
from ..files import weights_only_loadable  # whether torch.load(weights_only=True) reads a value back
from ..runtime import load_full_state_dict
from ..tools import state_of
from ..wrapping import check_stage, wrap
from ._common import is_wrapped

# Lightning's own state lives under this key of zero_ext.save's `extra`.
LIGHTNING_STATE_KEY = "lightning"
# What zero_ext.save holds itself: Lightning's copies are left out of `extra`.
_SAVED_BY_ZERO_EXT = ("state_dict", "optimizer_states")


class LightningNames:
    """What the strategy uses of one Lightning package (`lightning.pytorch`
    or `pytorch_lightning`): its classes, so that isinstance checks and
    comparisons see that package's objects."""

    def __init__(self, pl: ModuleType) -> None:
        package = pl.__name__
        self.package = package
        self.DDPStrategy = pl.strategies.DDPStrategy
        self.StrategyRegistry = pl.strategies.StrategyRegistry
        self.Precision = pl.plugins.precision.Precision
        self.TrainerFn = pl.trainer.states.TrainerFn
        self.LightningOptimizer = pl.core.optimizer.LightningOptimizer
        self.MockOptimizer = importlib.import_module(f"{package}.core.optimizer")._MockOptimizer
        self.sync_module_states = importlib.import_module(f"{package}.overrides.distributed")._sync_module_states
        self.default_pg_timeout = importlib.import_module(f"{package}.strategies.ddp").default_pg_timeout
        self.rank_zero_warn = pl.utilities.rank_zero.rank_zero_warn
        self.hparams_keys = (pl.LightningModule.CHECKPOINT_HYPER_PARAMS_KEY,
                             pl.LightningModule.CHECKPOINT_HYPER_PARAMS_NAME,
                             pl.LightningModule.CHECKPOINT_HYPER_PARAMS_TYPE)

    def plain_optimizer(self, optimizer: Any) -> Any:
        """The optimizer inside Lightning's LightningOptimizer wrapper."""
        return optimizer._optimizer if isinstance(optimizer, self.LightningOptimizer) else optimizer


def _lightning_state(checkpoint: Dict[str, Any], hparams_keys: Tuple[str, ...],
                     warn: Callable[[str], None]) -> Dict[str, Any]:
    """Lightning's checkpoint dict without what zero_ext.save holds itself.
    Hyperparameters that weights_only cannot read (objects given to
    save_hyperparameters) are left out with a warning: resuming does not use
    them. Anything else zero_ext.save refuses with the entry's name."""
    state = {k: v for k, v in checkpoint.items() if k not in _SAVED_BY_ZERO_EXT}
    dropped = [k for k in hparams_keys if k in state and not weights_only_loadable(state[k])]
    if dropped:
        warn(f"ZeroExtStrategy: the checkpoint leaves out {dropped}: torch.load(weights_only=True) cannot read "
             "them back, and zero_ext checkpoints are only ever read that way. Resuming does not need them; "
             "pass plain values (numbers, strings, lists, dicts) to save_hyperparameters() to keep them.")
    return {k: v for k, v in state.items() if k not in dropped}


def _full_weights(path: str) -> Dict[str, torch.Tensor]:
    """The checkpoint's full state_dict (parameters as fp32 masters), on CPU,
    by zero_ext.convert through a private temporary file."""
    from ..files import convert

    with tempfile.TemporaryDirectory(prefix="zero_ext_lightning_") as scratch:
        out = os.path.join(scratch, "weights.pt")
        convert(path, out)
        return torch.load(out, map_location="cpu", weights_only=True)


def _saved_extra(path: str, rank: int) -> Any:
    """This rank's `extra` of a checkpoint (rank 0's for a rank the writer
    did not have), read as zero_ext.load reads it, without a wrapped model."""
    from ..files import Checkpoint

    checkpoint = Checkpoint(path, "ZeroExtStrategy")
    try:
        writers = checkpoint.meta.world_size
        return checkpoint.load_pt(f"extra-rank{rank if rank < writers else 0}.pt")
    finally:
        checkpoint.close()


class PrecisionMethods:
    """ZeroExtPrecision's methods; its class sets `_lightning`."""

    _lightning: LightningNames

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        optimizer = self._lightning.plain_optimizer(optimizer)
        if not is_wrapped(optimizer):
            return super().clip_grad_by_norm(optimizer, clip_val)
        # The norm of the global gradient: every rank's shards (collective).
        optimizer.clip_grad_norm_(clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        optimizer = self._lightning.plain_optimizer(optimizer)
        if is_wrapped(optimizer):
            # Elementwise, so clipping the shards this rank steps is right
            # once the gradients are final: late reductions settled first.
            state_of(optimizer).handles.optimizer.settle()
        super().clip_grad_by_value(optimizer, clip_val)


class StrategyMethods:
    """ZeroExtStrategy's methods; its class sets `_lightning` and
    `_precision_class` (the ZeroExtPrecision of the same package)."""

    _lightning: LightningNames
    _precision_class: type

    def __init__(
        self,
        stage: int = 2,
        mixed_precision: Any = None,
        offload_optimizer: Optional[str] = None,
        units: Any = None,
        bucket_mb: Optional[float] = None,
        timeout: Optional[Any] = None,
        prefetch: int = 1,
        skip_nonfinite: bool = False,
        *,
        offload_params: Optional[str] = None,
        offload_path: Any = None,
        max_live_mb: Optional[float] = None,
        persist_kb: Optional[float] = None,
        accelerator: Any = None,
        parallel_devices: Optional[list] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: Optional[str] = None,
        start_method: str = "popen",
    ) -> None:
        # Checked here, in the launching process, before any rank starts;
        # wrap() checks the rest on every rank before communicating.
        check_stage(stage, "ZeroExtStrategy")
        if timeout is None:
            group_timeout = self._lightning.default_pg_timeout
        elif isinstance(timeout, datetime.timedelta):
            group_timeout = timeout
        else:
            group_timeout = datetime.timedelta(seconds=float(timeout))
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=group_timeout, start_method=start_method)
        self._wrap_options = dict(
            stage=stage, mixed_precision=mixed_precision, offload_optimizer=offload_optimizer, units=units,
            bucket_mb=bucket_mb, timeout=timeout, prefetch=prefetch, skip_nonfinite=skip_nonfinite,
            offload_params=offload_params, offload_path=offload_path, max_live_mb=max_live_mb,
            persist_kb=persist_kb)

    @property
    def stage(self) -> int:
        return self._wrap_options["stage"]

    # --- precision ------------------------------------------------------

    @property
    def precision_plugin(self) -> Any:
        return self._precision_plugin if self._precision_plugin is not None else self._precision_class()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        # Lightning's Trainer sets the plugin its precision flag names
        # here, so a refused flag fails at Trainer(...), on every rank.
        self._precision_plugin = self._checked_precision(plugin)

    def _checked_precision(self, plugin: Any) -> Any:
        """Lightning's full precision becomes ZeroExtPrecision; a plugin that
        would cast or scale on top of zero_ext is refused."""
        if plugin is None or isinstance(plugin, self._precision_class):
            return plugin
        if type(plugin) is self._lightning.Precision:
            return self._precision_class()
        flag = getattr(plugin, "precision", type(plugin).__name__)
        raise ValueError(
            f"ZeroExtStrategy does not run Lightning's precision plugin {type(plugin).__name__} "
            f"(precision={flag!r}): its autocast, casts or GradScaler would act on gradients zero_ext reduces, "
            "shards and scales itself. Leave Trainer(precision=...) at '32-true' and pass "
            "ZeroExtStrategy(mixed_precision='bf16') or ZeroExtStrategy(mixed_precision='fp16') (with "
            "zero_ext's own loss scaling) instead; zero_ext keeps fp32 master weights either way.")

    # --- setup: wrap once Lightning has built the optimizer ---------------

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == self._lightning.TrainerFn.FITTING
        if fitting and self._layer_sync and not is_wrapped(module):
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
        elif not is_wrapped(module):
            # Evaluation of a plain module: rank 0's weights everywhere, as DDPStrategy does.
            self._lightning.sync_module_states(self.model)
        self.setup_precision_plugin()
        # Unlike DDPStrategy, the optimizer's state is not moved to the
        # root device: zero_ext placed it (on the host with offload_optimizer).

    def configure_ddp(self) -> None:
        """No DDP: zero_ext.wrap in setup_optimizers does the data parallelism."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def setup_optimizers(self, trainer: Any) -> None:
        module = self.lightning_module
        if is_wrapped(module):
            raise RuntimeError(
                "ZeroExtStrategy: this LightningModule is already wrapped by zero_ext (by an earlier fit, or by a "
                "zero_ext.wrap call of its own), and a wrapped model cannot take the new optimizer "
                "configure_optimizers returns. Leave the wrapping to the strategy, and fit a fresh instance: "
                "resume with trainer.fit(new_module, ckpt_path=...) from a checkpoint of the earlier fit, or copy "
                "the weights over with new_module.load_state_dict(zero_ext.full_state_dict(module)).")
        super().setup_optimizers(trainer)
        optimizers = [self._lightning.plain_optimizer(o) for o in self.optimizers]
        if not optimizers or isinstance(optimizers[0], self._lightning.MockOptimizer):
            raise ValueError(
                "ZeroExtStrategy trains with the optimizers configure_optimizers returns, and it returned none. "
                "Return an optimizer over all trainable parameters, or several over disjoint parameters "
                "(Muon for the hidden matrices and AdamW for the rest, with manual optimization).")
        # Several optimizers over disjoint parameters are one zero_ext.wrap (a list): they make one step.
        wrap(module, optimizers if len(optimizers) > 1 else optimizers[0], **self._wrap_options)
        # The same objects, now of zero_ext's optimizer class: rebuild Lightning's wrappers around them.
        self.optimizers = optimizers

    def _zero_ext_optimizer(self) -> Union[torch.optim.Optimizer, List[torch.optim.Optimizer]]:
        """The wrapped optimizer, or the list of them (what zero_ext.save and load take)."""
        optimizers = [self._lightning.plain_optimizer(o) for o in self.optimizers]
        if not optimizers or not all(is_wrapped(o) for o in optimizers):
            raise RuntimeError("ZeroExtStrategy: no zero_ext optimizer yet; checkpoints are saved and loaded "
                               "by trainer.fit, once the module and its optimizer are wrapped")
        return optimizers if len(optimizers) > 1 else optimizers[0]

    # --- gradient accumulation -------------------------------------------

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: the backward passes before a step's last
        keep their gradients local; the last one reduces them all."""
        module = self.lightning_module
        if is_wrapped(module):
            with module.no_sync():
                yield None
        else:
            yield None

    # --- checkpoints ------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # zero_ext.load needs the wrapped module and optimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # zero_ext.load restored it (LR schedulers are still Lightning's)

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        if is_wrapped(self.lightning_module):
            return {}  # zero_ext.save writes the weights, as shards
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        if is_wrapped(self._lightning.plain_optimizer(optimizer)):
            return {}  # zero_ext.save writes the optimizer state, as shards
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        """Collective: Lightning calls it on every rank. Writes the
        directory `filepath` with zero_ext.save, atomically."""
        if storage_options is not None:
            raise TypeError("ZeroExtStrategy.save_checkpoint(..., storage_options=...) is not supported: "
                            "zero_ext.save writes the checkpoint, not Lightning's CheckpointIO")
        module = self.lightning_module
        if not is_wrapped(module):
            raise RuntimeError(
                "ZeroExtStrategy saves checkpoints of the model it trains: call trainer.save_checkpoint during "
                "or after trainer.fit (zero_ext.save needs the wrapped module and its optimizer)")
        path = self.broadcast(os.path.abspath(os.fspath(filepath)))  # rank 0's path on every rank
        state = _lightning_state(checkpoint, self._lightning.hparams_keys, self._lightning.rank_zero_warn)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        zero_ext_save(path, module, self._zero_ext_optimizer(), extra={LIGHTNING_STATE_KEY: state})

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Collective. A checkpoint directory of ZeroExtStrategy: in fit,
        model and optimizer by zero_ext.load; in validate/test/predict,
        the full weights. A plain Lightning checkpoint file: only for
        validate/test/predict, read with weights_only=True."""
        path = self.broadcast(os.path.abspath(os.fspath(checkpoint_path)))
        module = self.lightning_module
        fitting = module.trainer.state.fn == self._lightning.TrainerFn.FITTING
        if os.path.isfile(path):
            if fitting:
                raise ValueError(
                    f"ZeroExtStrategy resumes from the checkpoint directories it saves, and {path} is a file "
                    "(another strategy's checkpoint?); its optimizer state does not fit zero_ext's shards. To "
                    "start from its weights, load them into the module before fit, e.g. module.load_state_dict("
                    "torch.load(path, weights_only=True)['state_dict']), and fit without ckpt_path.")
            return super().load_checkpoint(path, weights_only=True)
        if fitting and is_wrapped(module):
            extra = zero_ext_load(path, module, self._zero_ext_optimizer(), strict=module.strict_loading)
        else:
            extra = _saved_extra(path, self.global_rank)
            weights = _full_weights(path)
            if is_wrapped(module):
                load_full_state_dict(module, weights)
            else:
                module.load_state_dict(weights, strict=module.strict_loading)
        state = extra.get(LIGHTNING_STATE_KEY) if isinstance(extra, dict) else None
        if not isinstance(state, dict):
            raise ValueError(
                f"ZeroExtStrategy: {path} is a zero_ext checkpoint without Lightning's state (loops, LR "
                "schedulers, callbacks), written by zero_ext.save rather than by a Trainer, so training cannot "
                "resume from it. To start from its weights and optimizer state, call zero_ext.load(path, module, "
                "optimizer) yourself, e.g. in the module's on_train_start, and fit without ckpt_path.")
        return state

    def load_model_state_dict(self, checkpoint: Dict[str, Any], strict: bool = True) -> None:
        # A ZeroExtStrategy checkpoint's weights were loaded by load_checkpoint;
        # only a plain checkpoint file's (evaluation) remain.
        if checkpoint.get("state_dict"):
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """zero_ext.load restored the optimizer in load_checkpoint."""

    # --- teardown ---------------------------------------------------------

    def teardown(self) -> None:
        if not is_wrapped(self.lightning_module):
            return super().teardown()
        # A wrapped module and its optimizer stay where they are: zero_ext's
        # buffers and groups are fixed to the device (moving them to the
        # CPU, as Lightning does, would fail on a GPU), and SyncBatchNorm is
        # kept (converting it back would replace wrapped parameters).
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "zero_ext", cls, description="ZeRO data parallelism by zero_ext (stage 2)", override=True)
