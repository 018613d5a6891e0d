"""``HpTrainer``: Hugging Face ``Trainer`` for a model parallelized by ``hp_core.apply``.

A plain ``Trainer`` (through accelerate) wraps the model in DDP over every rank and gives
every rank its own batch. With hp, the ranks of one tp/cp group hold different shards of
one model replica and must see the same batch; only the dp ranks are data-parallel. This
subclass changes exactly those places and nothing else:

* the model is wrapped in ``DistributedDataParallel`` over ``mesh["dp"]`` (accelerate then
  leaves it alone: ``Trainer`` skips its own wrap for a model it did not wrap);
* the training data is split over the dp ranks only (a ``DistributedSampler`` with the dp
  size and rank), so every rank of a tp group gets the same batch;
* token counts for the loss divide by the tp and cp sizes (``get_tp_size``/``get_cp_size``,
  the hooks ``Trainer`` already uses for ranks that share a batch);
* gradient clipping uses :func:`hp_core.clip_grad_norm_`, which counts each shard once.

Requires ``transformers`` and ``accelerate`` (``pip install 'hp-core[trainer]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from transformers import Trainer

from hp_core.errors import HpError
from hp_core.mesh import mesh_axes
from hp_core.runtime.clip import clip_grad_norm_

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["HpTrainer", "HpTrainerError"]


class HpTrainerError(HpError, ValueError):
    """``HpTrainer`` was given a model or mesh it cannot train correctly."""


class HpTrainer(Trainer):
    """``Trainer(model, args, ..., mesh=mesh)`` for a model on which ``hp_core.apply`` ran.

    ``mesh`` is the mesh given to ``apply``; it needs a ``dp`` axis (size 1 for tp only).
    """

    def __init__(self, *args: Any, mesh: DeviceMesh, **kwargs: Any) -> None:
        names = list(getattr(mesh, "mesh_dim_names", None) or ())
        if "dp" not in names:
            raise HpTrainerError(
                f"HpTrainer(mesh=...): the mesh has axes {names} but no 'dp' axis, which HpTrainer "
                "splits the data over. Build it with one, of size 1 when there is no data "
                "parallelism: init_device_mesh(device, (1, tp), mesh_dim_names=('dp', 'tp'))."
            )
        self.hp_mesh = mesh
        super().__init__(*args, **kwargs)
        if getattr(self.model, "_hp_applied", None) is None:
            raise HpTrainerError(
                f"HpTrainer: {type(self.model).__name__} was not parallelized by hp; call "
                "hp_core.apply(model, plan, mesh) first, or use transformers.Trainer."
            )

    def _applied(self) -> nn.Module:
        # __init__ refused anything but a model hp applied to, so this is that model.
        return cast(nn.Module, self.model)

    def _size(self, axis: str) -> int:
        names = list(mesh_axes(self.hp_mesh))
        return int(self.hp_mesh.shape[names.index(axis)]) if axis in names else 1

    # ------------------------------------------------------------------ ranks that share a batch
    def get_tp_size(self) -> int:
        return self._size("tp")

    def get_cp_size(self) -> int:
        return self._size("cp")

    # ------------------------------------------------------------------ the wrap
    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: DataLoader | None = None
    ) -> nn.Module:
        if isinstance(model, DistributedDataParallel) or not training:
            return model
        return DistributedDataParallel(
            model,
            process_group=self.hp_mesh["dp"].get_group(),
            find_unused_parameters=bool(self.args.ddp_find_unused_parameters),
        )

    # ------------------------------------------------------------------ the data
    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise HpTrainerError("HpTrainer: training requires a train_dataset.")
        dataset = self.train_dataset
        dp = self.hp_mesh["dp"]
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=dp.size(),
            rank=dp.get_local_rank(),
            shuffle=True,
            seed=self.args.seed,
            drop_last=self.args.dataloader_drop_last,
        )
        return DataLoader(
            dataset,
            batch_size=self._train_batch_size,
            sampler=sampler,
            collate_fn=self.data_collator,
            drop_last=self.args.dataloader_drop_last,
            num_workers=self.args.dataloader_num_workers,
        )

    # ------------------------------------------------------------------ clipping
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return clip_grad_norm_(self._applied(), self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float:
        if grad_norm is None:
            grad_norm = clip_grad_norm_(self._applied(), float("inf"))
        return float(grad_norm)
