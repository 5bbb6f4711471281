"""Training loops people already use, driving a model that :func:`autotp.parallelize` sharded.

- Hugging Face ``Trainer``: :class:`TrainerMixin` (or ``autotp.integrations.Trainer``, the mixin on
  ``transformers.Trainer``). Trainer assumes every process holds a whole replica: it splits the data over
  the whole job and lets accelerate wrap the model in DDP over all ranks. Under tensor parallelism both are
  wrong (the ranks of one TP group must see the same batch; a shard's gradient must be averaged only with
  the ranks holding the same shard). The mixin splits the training data over the data-parallel ranks only,
  wraps the model in DDP over its data-parallel group (nothing with ``fsdp``, whose reduce-scatters already
  run over it, or at dp 1), and saves the full model from every rank of the group.
- Lightning Fabric's ``ModelParallelStrategy``: :func:`fabric_parallelize_fn` gives the ``parallelize_fn`` it
  calls with its ("data_parallel", "tensor_parallel") device mesh.

Neither transformers nor lightning is imported by ``import autotp`` or by this module: only when a
name here that needs one is used.
"""
from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from autotp.combinations import refused
from autotp.errors import ShardingError
from autotp.state import TPState, find_tp_state

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TrainerMixin", "data_parallel_layout", "fabric_parallelize_fn"]  # and Trainer, made on first use


def _state(model: nn.Module) -> TPState:
    st = find_tp_state(model)
    if st is None:
        raise TypeError(f"{type(model).__name__} is not parallelized: call autotp.parallelize(model) before "
                        f"building the Trainer")
    return st


def data_parallel_layout(model: nn.Module) -> tuple[int, int, list[int]]:
    """(data-parallel size, this rank's data-parallel rank, the global ranks of its data-parallel group) for a
    parallelized ``model``: the ranks holding the same shard as this one, one per tensor-parallel group.

    Groups follow Megatron's order, as ``autotp run`` lays them out: tensor-parallel groups of adjacent ranks,
    data parallel across them. A pipeline or another grouping is refused rather than guessed."""
    st = _state(model)
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, [0]
    world, rank, tp = dist.get_world_size(), dist.get_rank(), st.tp
    from autotp.distributed.launch import current_job

    job = current_job()
    pp = 1 if job is None else job.grid.pp
    if (reason := refused(pipeline=pp, trainer=True)) is not None:
        raise ShardingError(reason.message, hint=reason.hint)
    start = rank // tp * tp
    members = dist.get_process_group_ranks(st.group) if tp > 1 else [rank]
    if world % tp or sorted(members) != list(range(start, start + tp)):
        raise ValueError(f"the model's tensor-parallel group {members} is not the group of {tp} adjacent ranks "
                         f"that data parallelism over {world} ranks expects (start the job with `autotp run`)")
    return world // tp, rank // tp, [rank % tp + i * tp for i in range(world // tp)]


def _group_of(ranks: list[int]) -> dist.ProcessGroup:
    """A process group of exactly ``ranks``: the data-parallel group of the job's mesh under autotp's launchers,
    else one made now for every data-parallel group (a collective: every rank reaches it, in the same order)."""
    from autotp.distributed.rank_context import current_context

    ctx = current_context()
    if ctx is not None and dist.get_process_group_ranks(ctx.dp_group()) == sorted(ranks):
        return ctx.dp_group()
    world, size = dist.get_world_size(), len(ranks)
    tp = world // size
    mine, _ = dist.new_subgroups_by_enumeration([[r + i * tp for i in range(size)] for r in range(tp)])
    return mine


class _EpochLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` reaches its DistributedSampler: Trainer calls it on the loader, and
    without it every epoch would draw the same order."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def _setting(args: Any, name: str) -> str:
    value = getattr(args, name, "no")  # an enum of str in TrainingArguments
    return str(getattr(value, "value", value))


class TrainerMixin:
    """Put before ``transformers.Trainer`` (or a subclass of it) in a class's bases, and give it a model that
    :func:`autotp.parallelize` sharded::

        class MyTrainer(TrainerMixin, transformers.Trainer): ...
        model = autotp.parallelize(model)
        MyTrainer(model=model, args=TrainingArguments(..., save_strategy="no"), train_dataset=ds).train()

    Under ``autotp run --tp T --dp D`` each of the D data-parallel replicas draws its own samples and the T
    ranks of a replica the same ones (a ``DistributedSampler`` over the data-parallel ranks, seeded by
    ``data_seed`` or ``seed``); gradients are averaged over the D ranks holding the same shard (DDP over
    the data-parallel group; with ``--fsdp`` FSDP2 already does it). ``per_device_train_batch_size`` is per
    replica. Losses and gradient norms Trainer logs are the full model's, as on one device.

    ``save_model()`` is a collective here: every rank gathers the full model and rank 0 writes it, as one
    ``from_pretrained`` loads. Trainer's own checkpoints (``save_strategy`` other than ``"no"``) are
    refused: they would save rank 0's optimizer shard as if it were the whole optimizer. So is evaluation
    (``evaluate``, ``predict``, an ``eval_strategy``), whose batches accelerate splits over every rank.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        st = _state(self.model)
        if _setting(self.args, "save_strategy") != "no":
            raise ValueError(
                "Trainer's checkpoints save one rank's optimizer state: with a parallelized model set "
                "TrainingArguments(save_strategy='no') and save the trained model with trainer.save_model() "
                "on every rank (or autotp.save_weights)")
        if _setting(self.args, "eval_strategy") != "no":
            self.get_eval_dataloader()  # refused: say so now rather than at the first evaluation
        # the parallelized class's forward is (*args, **kwargs): Trainer reads the label names, the dataset
        # columns to keep and whether to pass num_items_in_batch from the signature of the forward the user wrote
        from transformers.utils import can_return_loss, find_labels

        if self.args.label_names is None:
            self.label_names = find_labels(st.base)
        self.can_return_loss = can_return_loss(st.base)
        forward = st.forward or st.base.forward
        params = inspect.signature(forward).parameters
        self._signature_columns = [k for k in params if k != "self"]
        self._signature_columns += list({"label", "label_ids", *self.label_names})
        if not hasattr(type(self.model), "accepts_loss_kwargs"):
            self.model_accepts_loss_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())

    def get_tp_size(self) -> int:
        # Trainer divides its token counts by this: the ranks of a TP group count the same batch
        return _state(self.model).tp

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collate = self.train_dataset, self.data_collator
        datasets = sys.modules.get("datasets")  # a datasets.Dataset means the package is imported already
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        options = {"batch_size": self._train_batch_size, "collate_fn": collate,
                   "num_workers": self.args.dataloader_num_workers, "pin_memory": self.args.dataloader_pin_memory,
                   "persistent_workers": self.args.dataloader_persistent_workers}
        if isinstance(dataset, IterableDataset):  # no sampler to shard: the dataset yields each replica's data
            return DataLoader(dataset, **options)
        dp, dp_rank, _ = data_parallel_layout(self.model)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        # Trainer would hand the loader to accelerate, which shards batches over the whole job; this one is
        # already sharded, over the data-parallel ranks only, and Trainer moves each batch to the device itself
        sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=True, seed=seed,
                                     drop_last=self.args.dataloader_drop_last)
        return _EpochLoader(dataset, sampler=sampler, drop_last=self.args.dataloader_drop_last, **options)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        # accelerate would split evaluation batches over every rank (an InputMismatchError at the first batch)
        # and gather the predictions of every rank, tp copies of each; refused until both are done per replica
        raise NotImplementedError("evaluation through Trainer is not supported with a parallelized model: "
                                  "evaluate in a loop of your own (every rank of a tensor-parallel group "
                                  "calling the model on the same batch)")

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        return self.get_eval_dataloader(test_dataset)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: DataLoader | None = None) -> nn.Module:
        if not training:
            return super()._wrap_model(model, training, dataloader)
        if model is not self.model:
            return model  # Trainer passes its model_wrapped: wrapped by an earlier train()
        # what accelerate adds to a model (autocast for mixed precision, torch.compile) but not its DDP over
        # the whole job; the model comes back marked prepared, so Trainer's own prepare() leaves it as it is
        model = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        st = _state(self.model)
        dp, _, ranks = data_parallel_layout(self.model)
        if dp == 1 or st.options.fsdp is not None:
            return model
        return torch.nn.parallel.DistributedDataParallel(
            model, process_group=_group_of(ranks),
            device_ids=[st.device.index] if st.device.type == "cuda" else None)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = self.args.output_dir if output_dir is None else output_dir
        model = self.model  # Trainer keeps the user's model here; model_wrapped is the DDP around it
        if hasattr(model, "save_pretrained"):
            # collective: the full model is gathered on every rank of the group, and global rank 0 writes it
            model.save_pretrained(output_dir, is_main_process=self.args.should_save)
        else:
            from autotp.io.checkpoint import full_state_dict

            state = full_state_dict(model)  # collective too
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                torch.save(state, os.path.join(output_dir, "pytorch_model.bin"))
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # the files are complete when any rank returns


def __getattr__(name: str) -> object:
    # autotp.integrations.Trainer: the mixin on transformers.Trainer, made when first asked for, so that this
    # module does not import transformers
    if name == "Trainer":
        import transformers

        cls = type("Trainer", (TrainerMixin, transformers.Trainer), {"__module__": __name__,
                                                                      "__doc__": TrainerMixin.__doc__})
        globals()["Trainer"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fabric_parallelize_fn(fsdp: bool = True, **options: Any) -> Callable[[nn.Module, DeviceMesh], nn.Module]:
    """The ``parallelize_fn`` for Lightning Fabric's ``ModelParallelStrategy``: it calls
    :func:`autotp.parallelize` on the model with the strategy's device mesh.

    Fabric's mesh has dims ("data_parallel", "tensor_parallel"), tensor parallel innermost as in autotp's
    rank grid. The model is sharded over the "tensor_parallel" dim; with more than one data-parallel rank it is
    also sharded over "data_parallel" with FSDP2 (``fsdp=True``, what the strategy expects a
    ``parallelize_fn`` to do, and what its sharded checkpoints assume) or wrapped in DDP over it
    (``fsdp=False``). ``options`` go to :func:`autotp.parallelize` (``sequence_parallel``, ``compile``, ...).
    """
    def parallelize_fn(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh

        from autotp.parallel.parallelize import parallelize

        names = device_mesh.mesh_dim_names or ()
        if names != ("data_parallel", "tensor_parallel"):
            raise ValueError(f"expected Fabric's ('data_parallel', 'tensor_parallel') device mesh, got dims {names}")
        dp_mesh, tp_mesh = device_mesh["data_parallel"], device_mesh["tensor_parallel"]
        if dp_mesh.size() > 1 and fsdp:
            # the same mesh under the dim names autotp's FSDP reads, over the groups Fabric already made
            mesh = DeviceMesh.from_group([dp_mesh.get_group(), tp_mesh.get_group()], device_mesh.device_type,
                                         mesh=device_mesh.mesh, mesh_dim_names=("dp", "tp"))
            return parallelize(model, fsdp=True, mesh=mesh, **options)
        model = parallelize(model, tp_group=tp_mesh.get_group(), fsdp=False, **options)
        if dp_mesh.size() == 1:
            return model
        device = find_tp_state(model).device
        return torch.nn.parallel.DistributedDataParallel(
            model, process_group=dp_mesh.get_group(), device_ids=[device.index] if device.type == "cuda" else None)

    return parallelize_fn
