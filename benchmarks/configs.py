"""The configurations the benchmark compares: what each one does and which run is its reference.

Pure data (no torch, no Ray): the orchestrator plans rounds from it, the workers look savers up by ``saver``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    name: str
    label: str            #: short human label (plots, tables)
    hook: str             #: DDP communication hook: "none" (plain allreduce) or "topk" (top-k 1%)
    reference: str        #: the configuration whose step time is this one's 0% overhead
    saver: str            #: what the training loop does after each step (benchmarks.worker.SAVERS)
    launcher: str = "mp"  #: "mp" (2 forked processes, DDP) or "raytrain" (TorchTrainer, 2 Ray workers)
    ray: bool = False     #: rank 0 connects to the benchmark's Ray cluster
    every: int = 1        #: checkpoint every this many steps
    fail_test: bool = True  #: take part in the steps-lost-on-failure experiment
    full_every: int | None = None  #: LowDiff/Amber full period for this configuration (None: the run's)
    note: str = ""


CONFIGS: list[Config] = [
    Config("none", "no ckpt (DDP)", "none", "none", "none", fail_test=False,
           note="plain DDP allreduce, no checkpointing: the reference for every dense baseline"),
    Config("topk_none", "top-k 1%, no ckpt", "topk", "none", "none", fail_test=False,
           note="top-k 1% DDP hook, no checkpointing: the reference for LowDiff top-k; its own overhead vs "
                "plain DDP is the cost of compression"),
    Config("torch_save_1", "torch.save every step", "none", "none", "torch_save", every=1,
           note="torch.save(model+optimizer+scheduler) to a temp file + os.replace, synchronous, rank 0"),
    Config("torch_save_10", "torch.save every 10", "none", "none", "torch_save", every=10,
           note="same, every 10 steps"),
    Config("dcp_async", "DCP async_save every step", "none", "none", "dcp_async",
           note="torch.distributed.checkpoint.async_save of get_state_dict(model, optimizer) on every rank "
                "(own gloo group), waiting for the previous save's future first; default FileSystemWriter "
                "(fsync on)"),
    Config("checkfreq", "CheckFreq snapshot+persist", "none", "none", "checkfreq",
           note="CheckFreq-style: copy model+optimizer state into preallocated host buffers (waiting for the "
                "previous persist first), then torch.save in a background thread, every step"),
    Config("raytrain_none", "Ray Train, no report", "none", "raytrain_none", "none", launcher="raytrain",
           fail_test=False,
           note="the same loop inside TorchTrainer (2 Ray workers), no ray.train.report: the reference for "
                "Ray Train's report"),
    Config("raytrain_report", "Ray Train report every step", "none", "raytrain_none", "raytrain_report",
           launcher="raytrain", fail_test=False,
           note="ray.train.report(metrics, checkpoint=Checkpoint.from_directory(torch.save'd dir), "
                "checkpoint_upload_mode=ASYNC) every step (rank 0 with the checkpoint, rank 1 without)"),
    Config("lowdiff_topk", "LowDiff top-k (local)", "topk", "topk_none", "lowdiff",
           note="ray_ckpt.Checkpointer(runtime='local'), LowDiff, top-k 1% hook, every step"),
    Config("lowdiff_topk_nofull", "LowDiff top-k, diffs only", "topk", "topk_none", "lowdiff",
           full_every=10**9, fail_test=False,
           note="as lowdiff_topk but no full checkpoint inside the measured segment (only the one at attach): "
                "the steady-state cost of a diff step; with lowdiff_topk it separates the cost of a full"),
    Config("lowdiff_topk_ray", "LowDiff top-k (ray)", "topk", "topk_none", "lowdiff_ray", ray=True,
           note="ray_ckpt.Checkpointer(runtime='ray'): memory tier in a PersistenceWorker actor"),
    Config("lowdiff_topk_ray_trainer_fulls", "LowDiff top-k (ray, trainer fulls)", "topk", "topk_none",
           "lowdiff_ray_trainer_fulls", ray=True, fail_test=False,
           note="as lowdiff_topk_ray with replica=False: the training process snapshots and hands over every full "
                "itself (the state tier's replica fulls switched off): the reference point for fulls from the replica"),
    Config("lowdiff_dense", "LowDiff dense (local)", "none", "none", "lowdiff",
           note="ray_ckpt.Checkpointer(runtime='local'), LowDiff without compression: dense gradients"),
    Config("lowdiff_dense_ray", "LowDiff dense (ray)", "none", "none", "lowdiff_ray", ray=True,
           fail_test=False,
           note="runtime='ray' without compression: dense gradients every step to the PersistenceWorker and the "
                "shadow replica; every diff also written to storage (durable_diffs='all')"),
    Config("lowdiff_dense_ray_fulls", "LowDiff dense (ray, durable fulls)", "none", "none", "lowdiff_ray_fulls",
           ray=True, fail_test=False,
           note="as lowdiff_dense_ray with durable_diffs='fulls': diffs held in memory on two nodes, written only "
                "when their second copy is missing (on this one-node benchmark cluster: always, see README)"),
    Config("amber", "Amber (local)", "none", "none", "amber",
           note="ray_ckpt.Amber() selective incremental checkpointing, runtime='local' (if available)"),
]

BY_NAME = {c.name: c for c in CONFIGS}


def get(name: str) -> Config:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown configuration {name!r}; choose from {[c.name for c in CONFIGS]}") from None
