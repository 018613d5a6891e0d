"""Hugging Face ``Trainer`` on an hp model: ``hp_core.hf_trainer.HpTrainer``, dp=2 x tp=2.

    torchrun --nproc-per-node 4 examples/hf_trainer_train.py          # dp=2 x tp=2 on CPU
    torchrun --nproc-per-node 4 examples/hf_trainer_train.py --check  # and compare with one device

The order of calls: one mesh with a ``dp`` axis, ``hp_core.plan`` and ``hp_core.apply``, then
``HpTrainer(model=model, args=..., train_dataset=..., mesh=mesh).train()``. ``HpTrainer``
wraps the model in DDP over the dp ranks only, splits the data over the dp ranks only, and
clips with ``hp_core.clip_grad_norm_``. A plain ``transformers.Trainer`` would wrap it in
DDP over every rank; hp refuses that at the first forward.

With ``--check`` every rank also trains an unsharded copy on the union of the dp ranks'
batches, and the script fails unless every step's gradient norm and the trained models'
loss and logits on a probe batch agree with it to 1e-5.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DistributedSampler
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

import hp_core
from hp_core.hf_trainer import HpTrainer
from hp_core.testing.compare import nan_safe_max
from hp_core.testing.families import build_family, family_batch

LR, MAX_NORM, STEPS, PER_DEVICE = 1e-3, 0.5, 3, 2


class _Norms(TrainerCallback):
    """The gradient norm Trainer logs at every step."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs and "grad_norm" in logs:
            self.norms.append(float(logs["grad_norm"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="compare with one device")
    parser.add_argument(
        "--plain", action="store_true", help="use transformers.Trainer instead (hp refuses it)"
    )
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        print(
            "launch with torchrun, e.g.: torchrun --nproc-per-node 4 examples/hf_trainer_train.py",
            file=sys.stderr,
        )
        return 2
    dist.init_process_group("gloo")
    try:
        return 0 if train(args) else 1
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace) -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    model = build_family(args.model, seed=0)
    reference = copy.deepcopy(model) if args.check else None
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)

    ids = family_batch(args.model, batch=16, seed=7)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    norms = _Norms()
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            max_steps=STEPS,
            per_device_train_batch_size=PER_DEVICE,
            learning_rate=LR,
            lr_scheduler_type="constant",
            max_grad_norm=MAX_NORM,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=42,
        )
        common = {
            "model": model,
            "args": training,
            "train_dataset": dataset,
            "data_collator": default_data_collator,
            "callbacks": [norms],
        }
        trainer = Trainer(**common) if args.plain else HpTrainer(**common, mesh=mesh)
        trainer.train()
    if reference is None:
        return True
    ref_norms = _reference(reference, dataset, mesh["dp"].size(), training)
    probe = family_batch(args.model, seed=99)
    model.eval()
    reference.eval()
    with torch.no_grad():
        got = model(input_ids=probe, labels=probe, use_cache=False)
        want = reference(input_ids=probe, labels=probe, use_cache=False)
    diffs = (
        [abs(a - b) for a, b in zip(norms.norms, ref_norms, strict=True)]
        if len(norms.norms) == len(ref_norms)
        else [float("inf")]
    )
    diffs += [
        abs(float(got.loss) - float(want.loss)),
        float((got.logits - want.logits).abs().max()),
    ]
    worst = nan_safe_max(diffs)  # a NaN anywhere is an infinite difference
    ok = worst <= 1e-5
    if rank == 0:
        print(
            f"grad norms {[round(n, 6) for n in norms.norms]} vs one device "
            f"{[round(n, 6) for n in ref_norms]}; worst difference {worst:.2e}"
        )
        print(
            "every step matches the single-device run"
            if ok
            else "MISMATCH against the single-device run"
        )
    return ok


def _reference(
    model: torch.nn.Module,
    dataset: list[dict[str, torch.Tensor]],
    dp: int,
    training: TrainingArguments,
) -> list[float]:
    """The same steps on one device: each step's batch is the union of the dp ranks' batches."""
    samplers = [
        DistributedSampler(dataset, num_replicas=dp, rank=r, shuffle=True, seed=training.seed)
        for r in range(dp)
    ]
    orders = [list(s) for s in samplers]
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=LR,
        betas=(training.adam_beta1, training.adam_beta2),
        eps=training.adam_epsilon,
        weight_decay=0.0,
    )
    norms: list[float] = []
    for step in range(STEPS):
        rows = [
            dataset[i]["input_ids"]
            for order in orders
            for i in order[step * PER_DEVICE : (step + 1) * PER_DEVICE]
        ]
        batch = torch.stack(rows)
        opt.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return norms


if __name__ == "__main__":
    sys.exit(main())
