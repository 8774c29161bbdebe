"""Amber's figures on the GPT example (preset "small", 3.3M parameters) trained on the stdlib corpus with AdamW.

    .venv/bin/python -m benchmarks.amber_table [--quick] [--out benchmarks/results] [--parts 1,2]

Part 1, the table (the real pipeline): for fp32 and bf16 weights and thresholds {0 (lossless), 0.5%, 2%, 5%},
one training run of N steps with ``Checkpointer(strategy=Amber(threshold=τ))`` (defaults otherwise: every
step an increment, batches of 10 steps, a scheduled full every 100 steps, the chain policy's merges and early
fulls), then a restore of the latest step from storage into a fresh model. Reported: bytes per increment as a
fraction of a full checkpoint (the full = model + AdamW state, the attach-time full object), the capture time
per step on the training thread, the writer-thread encode time, and the held-out loss of the restored model
(right after the restore, and after K more training steps) against the exact state's. A plain run without
checkpointing gives the exact state and the baseline step time.

Part 2, the design choices (offline, same code): one training run per dtype; after every step a host
snapshot of parameters + AdamW state feeds several ``AmberEncoder`` s side by side (the writer-side code of the
pipeline, with fulls every F steps). Compared: optimizer-state treatments (same rule at 2% / 10% / 25%,
lossless, full schedule), encodings (sparse vs XOR+zstd, lossless and at 2%; XOR's encode+decode+apply round
trip timed), adaptive per-layer thresholds (budget 1% / 5% of the parameter bytes). For each: bytes per
increment, encode time, restored-state error at step N, held-out loss after K more steps from the restored
state. The restored state is the encoder's saved values, which is what a restore returns (Part 1 checks that
equality on the real pipeline).

Writes ``amber_table.json`` and ``amber_table.md`` under ``--out``. Averages are over steps 2..N (step 1
creates the AdamW moments, which every mode stores whole once).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

import ray_ckpt
from benchmarks import report
from examples.gpt import GPT, ByteBatches, GPTConfig, stdlib_corpus, warmup_cosine
from ray_ckpt.config import Amber
from ray_ckpt.engine.amber import AmberEncoder
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.format.delta import AmberRecord, apply_delta, decode_records, encode_records
from ray_ckpt.storage import open_storage

THRESHOLDS = (0.0, 0.005, 0.02, 0.05)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Setup:
    steps: int            #: N training steps checkpointed
    cont: int             #: K steps of continued training after the restore
    full_every: int
    batch_steps: int
    eval_batches: int
    batch: int = 8
    lr: float = 1e-3
    preset: str = "small"


QUICK = Setup(steps=30, cont=5, full_every=20, batch_steps=5, eval_batches=4)
FULL = Setup(steps=150, cont=20, full_every=100, batch_steps=10, eval_batches=8)


# ------------------------------------------------------------------------------------------------------------
def make(dtype, su: Setup, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig.preset(su.preset)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=su.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sch = warmup_cosine(opt, warmup=max(1, su.steps // 10), total=su.steps + su.cont)
    return model, opt, sch


def train_step(model, opt, sch, data, step: int) -> float:
    x, y = data.get(step)
    opt.zero_grad(set_to_none=True)
    loss = model.loss(x, y)
    loss.backward()
    loss = loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sch.step()
    return float(loss)


def continue_and_eval(model, opt, sch, data, su: Setup, start: int | None = None) -> float:
    """K more training steps from step ``start`` (default N), then the held-out loss."""
    start = su.steps if start is None else start
    for s in range(start, start + su.cont):
        train_step(model, opt, sch, data, s)
    return data.heldout_loss(model, su.eval_batches)


def clone_run(model, opt, sch, dtype, su: Setup):
    """A fresh model/optimizer/scheduler holding a copy of the given state."""
    m2, o2, s2 = make(dtype, su, seed=1)
    m2.load_state_dict(copy.deepcopy(model.state_dict()))
    o2.load_state_dict(copy.deepcopy(opt.state_dict()))
    s2.load_state_dict(copy.deepcopy(sch.state_dict()))
    return m2, o2, s2


def state_errors(params_r, params_x, moments_r=None, moments_x=None) -> dict:
    """Restored vs exact: max relative error of the parameters (|r−x|/|r|), fraction of stale parameter
    elements, and relative L2 errors of the moments."""
    worst, stale, total = 0.0, 0, 0
    for r, x in zip(params_r, params_x):
        r, x = r.double(), x.double()
        diff = (r - x).abs()
        nz = r != 0
        if nz.any():
            worst = max(worst, float((diff[nz] / r[nz].abs()).max()))
        stale += int((diff != 0).sum())
        total += r.numel()
    out = {"param_max_rel_err": worst, "param_stale_frac": stale / max(total, 1)}
    if moments_r is not None:
        for key in ("exp_avg", "exp_avg_sq"):
            num = sum(float(((moments_r[i][key].double() - moments_x[i][key].double()) ** 2).sum())
                      for i in moments_x)
            den = sum(float((moments_x[i][key].double() ** 2).sum()) for i in moments_x)
            out[f"{key}_rel_l2_err"] = (num / den) ** 0.5 if den else 0.0
    return out


def _mean(xs):
    xs = list(xs)
    return statistics.fmean(xs) if xs else 0.0


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "load_avg_at_start": load}


# ------------------------------------------------------------------------------------------------------------
# Part 1: the real pipeline
def pipeline_run(dn: str, thr: float, su: Setup, data, workdir: str) -> tuple[dict, int, dict]:
    """Train N steps with Amber(threshold=thr), then restore the latest step whose plan holds increments (the
    latest step may be a full the chain policy took: that restore would be exact). Returns the row, that
    step R and the restored state (for the comparison with the exact state at R)."""
    dtype = DTYPES[dn]
    model, opt, sch = make(dtype, su)
    uri = os.path.join(workdir, f"amber-{dn}-{thr}")
    shutil.rmtree(uri, ignore_errors=True)
    t0 = time.perf_counter()
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, strategy=Amber(threshold=thr),
                               full_every=su.full_every, batch_steps=su.batch_steps) as ck:
        for s in range(su.steps):
            train_step(model, opt, sch, data, s)
        train_s = time.perf_counter() - t0
        cap = ck._capture
    stats = ck.stats()
    enc = cap.encoder
    hist = [h for h in enc.history if h["kind"] == "step"]
    storage = open_storage(uri)
    lin, _ = load_lineage(storage)
    fulls = [m for m in lin.manifests if m.kind == "full"]
    full_bytes = max(m.nbytes for m in fulls)           # a full with the AdamW state (the attach full has none)
    merged = [m for m in lin.manifests if m.kind == "diff" and m.info.get("atomic")]
    target = next(s for s in reversed(lin.reachable_steps(lin.generations[-1])) if lin.resolve(s).diffs)
    plan = lin.resolve(target)
    loop_diff_bytes = sum(m.nbytes for m in lin.manifests if m.kind == "diff")
    loop_full_bytes = sum(m.nbytes for m in fulls if m.last_step != 0)
    inc = [h["bytes"] for h in hist if h["step"] >= 2]
    late = [h["bytes"] for h in hist if h["step"] > su.steps * 3 // 4]

    m2, o2, s2 = make(dtype, su, seed=1)
    t1 = time.perf_counter()
    got = ray_ckpt.restore(uri, m2, o2, scheduler=s2, step=target)
    restore_s = time.perf_counter() - t1
    assert got == target, got
    if target == su.steps:   # the restored parameters are exactly the encoder's saved values
        for i, p in enumerate(m2.parameters()):
            assert torch.equal(p.detach(), enc.ref[("p", i, None)]), f"parameter {i}: restore != saved values"
    restored = {"params": [p.detach().clone() for p in m2.parameters()],
                "moments": {i: {k: o2.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                            for i, p in enumerate(m2.parameters())}}
    loss = data.heldout_loss(m2, su.eval_batches)
    cont = continue_and_eval(m2, o2, s2, data, su, start=target)
    shutil.rmtree(uri, ignore_errors=True)
    row = {
        "dtype": dn, "threshold": thr, "full_bytes": full_bytes,
        "inc_frac": _mean(inc) / full_bytes, "inc_frac_late": _mean(late) / full_bytes,
        "param_frac": _mean(h["param_bytes"] for h in hist if h["step"] >= 2) / full_bytes,
        "opt_frac": _mean(h["opt_bytes"] for h in hist if h["step"] >= 2) / full_bytes,
        "diff_objects_frac": loop_diff_bytes / su.steps / full_bytes,
        "written_frac": (loop_diff_bytes + loop_full_bytes) / su.steps / full_bytes,
        "capture_ms": 1e3 * stats["capture_seconds"] / su.steps,
        "encode_ms": 1e3 * enc.encode_seconds / max(len(hist), 1),
        "step_ms": 1e3 * train_s / su.steps, "stall_s": stats["stall_seconds"],
        "fulls": len(fulls) - 1, "early_fulls": cap.early_fulls, "merged_objects": len(merged),
        "restore_step": target, "restore_full_step": plan.full.last_step, "restore_s": restore_s,
        "restore_objects": 1 + len(plan.diffs), "restore_bytes": plan.full.nbytes + sum(m.nbytes for m in plan.diffs),
        "loss_restored": loss, "loss_restored_cont": cont,
    }
    return row, target, restored


def exact_run(dn: str, su: Setup, data, targets: set[int]) -> dict:
    """The run without checkpointing: step time, and at each target step the exact state, its held-out loss
    and the held-out loss after K more steps."""
    dtype = DTYPES[dn]
    model, opt, sch = make(dtype, su)
    at: dict[int, dict] = {}
    t_train = 0.0
    for s in range(su.steps):
        t0 = time.perf_counter()
        train_step(model, opt, sch, data, s)
        t_train += time.perf_counter() - t0
        if s + 1 in targets:
            state = {"params": [p.detach().clone() for p in model.parameters()],
                     "moments": {i: {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                                 for i, p in enumerate(model.parameters())}}
            loss = data.heldout_loss(model, su.eval_batches)
            cont = continue_and_eval(*clone_run(model, opt, sch, dtype, su), data, su, start=s + 1)
            at[s + 1] = {"state": state, "loss": loss, "loss_cont": cont}
    return {"step_s": t_train / su.steps, "at": at}


# ------------------------------------------------------------------------------------------------------------
# Part 2: design choices, offline
def offline_configs(dtype_name: str) -> dict[str, Amber]:
    c = {
        "opt: same rule 2%": Amber(threshold=0.02, optimizer_state="threshold", optimizer_every=1,
                                   encoding="sparse"),
        "opt: rule at 10%": Amber(threshold=0.02, optimizer_state="threshold", optimizer_threshold=0.10,
                                  optimizer_every=1, encoding="sparse"),
        "opt: rule at 25%": Amber(threshold=0.02, optimizer_state="threshold", optimizer_threshold=0.25,
                                  optimizer_every=1, encoding="sparse"),
        "opt: lossless": Amber(threshold=0.02, optimizer_state="lossless", optimizer_every=1, encoding="sparse"),
        "opt: full schedule": Amber(threshold=0.02, optimizer_state="full", encoding="sparse"),
        "opt: every 10 steps, lossless": Amber(threshold=0.02, optimizer_state="lossless", optimizer_every=10,
                                               encoding="sparse"),
        "opt: every 10 steps, rule 25%": Amber(threshold=0.02, optimizer_state="threshold", optimizer_threshold=0.25,
                                               optimizer_every=10, encoding="sparse"),
        "enc: lossless sparse": Amber(threshold=0.0, encoding="sparse"),
        "enc: lossless xor": Amber(threshold=0.0, encoding="xor"),
        "enc: 2% sparse": Amber(threshold=0.02, optimizer_state="full", encoding="sparse"),
        "enc: 2% xor": Amber(threshold=0.02, optimizer_state="full", encoding="xor"),
        "atol: 2% + atol 1e-4": Amber(threshold=0.02, atol=1e-4, optimizer_state="full", encoding="sparse"),
        "adaptive: budget 1%": Amber(threshold=0.005, budget_fraction=0.01, max_threshold=0.1,
                                     optimizer_state="full", encoding="sparse"),
        "adaptive: budget 5%": Amber(threshold=0.005, budget_fraction=0.05, max_threshold=0.1,
                                     optimizer_state="full", encoding="sparse"),
        "adaptive: budget 20%": Amber(threshold=0.005, budget_fraction=0.2, max_threshold=0.1,
                                      optimizer_state="full", encoding="sparse"),
        "adaptive: budget 1% + atol 1e-4": Amber(threshold=0.005, atol=1e-4, budget_fraction=0.01,
                                                 max_threshold=0.1, optimizer_state="full", encoding="sparse"),
    }
    if dtype_name == "bf16":
        c = {k: v for k, v in c.items() if k.startswith("enc:") or k == "opt: full schedule"}
    return c


ROUNDTRIP = ("enc: lossless sparse", "enc: lossless xor", "enc: 2% sparse", "enc: 2% xor")


def offline_run(dtype_name: str, su: Setup, data) -> list[dict]:
    dtype = DTYPES[dtype_name]
    configs = offline_configs(dtype_name)
    model, opt, sch = make(dtype, su)
    params = list(model.parameters())

    def snap_all() -> dict:
        d = {("p", i, None): p.detach().clone() for i, p in enumerate(params)}
        for i, p in enumerate(params):
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    d[("o", i, k)] = v.detach().clone()
        return d

    def tracked(snap: dict, cfg: Amber, step: int | None = None) -> dict:
        """What the capture sends at ``step`` (None: at a full): the optimizer tensors only on their
        schedule, and once when they are created (step 1)."""
        mode = cfg.resolved_optimizer_state
        if step is None or step == 1 or (mode != "full" and step % cfg.resolved_optimizer_every == 0):
            return snap if (mode != "full" or step == 1) else tracked(snap, cfg, 2)
        return {s: t for s, t in snap.items() if s[0] == "p" or t.numel() <= 1 or not t.is_floating_point()}

    encs = {n: AmberEncoder(c) for n, c in configs.items()}
    s0 = snap_all()
    for n, e in encs.items():
        e.rebase(0, tracked(s0, configs[n]))
    applied = {n: {k: v.clone() for k, v in tracked(s0, configs[n]).items()} for n in ROUNDTRIP if n in encs}
    rt_seconds = {n: 0.0 for n in applied}
    full_moments: dict = {}
    full_bytes = sum(t.numel() * t.element_size() for t in s0.values())
    for s in range(su.steps):
        train_step(model, opt, sch, data, s)
        step = s + 1
        snap = snap_all()
        if step == 1:
            full_bytes = sum(t.numel() * t.element_size() for t in snap.values())
        if step == 1 or step % su.full_every == 0:
            full_moments = {k: v for k, v in snap.items() if k[0] == "o"}
        for n, e in encs.items():
            full_now = step % su.full_every == 0
            out = e.encode_step(AmberRecord(step=step, snap=tracked(snap, configs[n], None if full_now else step)))
            if n in applied:
                t0 = time.perf_counter()
                data_ = b"".join(bytes(b) for b in encode_records([out]))
                for d in decode_records(data_, n)[0].deltas:
                    tgt = applied[n].get(d.slot_id)
                    if d.enc == "new" or tgt is None:
                        applied[n][d.slot_id] = d.parts["v"].reshape(d.shape).clone()
                    else:
                        apply_delta(d, tgt)
                rt_seconds[n] += time.perf_counter() - t0
            if full_now:
                e.rebase(step, tracked(snap, configs[n]))
                if n in applied:
                    applied[n] = {k: v.clone() for k, v in tracked(snap, configs[n]).items()}
    exact_snap = snap_all()
    exact_params = [p.detach().clone() for p in params]
    exact_moments = {i: {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")} for i, p in enumerate(params)}
    for n in applied:   # what the round trip rebuilt is what the encoder saved
        for slot, v in applied[n].items():
            assert torch.equal(v, encs[n].ref[slot]), (n, slot)
    rows = []
    base = clone_run(model, opt, sch, dtype, su)
    exact_loss = data.heldout_loss(model, su.eval_batches)
    exact_cont = continue_and_eval(*base, data, su)
    for n, e in encs.items():
        cfg = configs[n]
        hist = [h for h in e.history if h["kind"] == "step" and h["step"] >= 2]
        m2, o2, s2 = clone_run(model, opt, sch, dtype, su)
        p2 = list(m2.parameters())
        with torch.no_grad():
            for i, p in enumerate(p2):
                p.copy_(e.ref[("p", i, None)])
            for i, p in enumerate(p2):
                for k in ("exp_avg", "exp_avg_sq"):
                    src = e.ref.get(("o", i, k)) if cfg.resolved_optimizer_state != "full" else None
                    if src is None:
                        src = full_moments[("o", i, k)]
                    o2.state[p][k].copy_(src)
        moments_r = {i: {k: o2.state[p][k] for k in ("exp_avg", "exp_avg_sq")} for i, p in enumerate(p2)}
        errs = state_errors([p.detach() for p in p2], exact_params, moments_r, exact_moments)
        loss = data.heldout_loss(m2, su.eval_batches)
        cont = continue_and_eval(m2, o2, s2, data, su)
        row = {"dtype": dtype_name, "config": n, "threshold": cfg.threshold,
               "optimizer_state": cfg.resolved_optimizer_state, "optimizer_threshold": cfg.optimizer_threshold,
               "encoding": cfg.encoding, "budget_fraction": cfg.budget_fraction, "full_bytes": full_bytes,
               "inc_frac": _mean(h["bytes"] for h in hist) / full_bytes,
               "param_frac": _mean(h["param_bytes"] for h in hist) / full_bytes,
               "opt_frac": _mean(h["opt_bytes"] for h in hist) / full_bytes,
               "param_frac_of_params": _mean(h["param_bytes"] for h in hist)
               / sum(t.numel() * t.element_size() for k, t in exact_snap.items() if k[0] == "p"),
               "encode_ms": 1e3 * _mean(h["seconds"] for h in hist),
               "roundtrip_ms": 1e3 * rt_seconds[n] / su.steps if n in rt_seconds else None,
               "loss_exact": exact_loss, "loss_restored": loss, "loss_exact_cont": exact_cont,
               "loss_restored_cont": cont, **errs}
        if cfg.budget_fraction is not None:
            row["thresholds_in_force_last"] = {str(k): v for k, v in sorted(e.last_thresholds.items())}
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------------
def _frac_pct(x):
    """A fraction as a percentage: ``0.0123`` -> ``1.23%``."""
    return report.pct(100 * x, ".2f")


def markdown(result: dict) -> str:
    su, mach = result["setup"], result["machine"]
    out = [f"# Amber on the GPT example ({result['mode']} mode)", "",
           f"Measured {result['date']} on {mach['cpu']} ({mach['cores']} cores, torch {mach['torch']}, "
           f"{mach['torch_threads']} intra-op threads; load average at start {mach['load_avg_at_start']}). "
           f"Model: examples/gpt.py preset \"{su['preset']}\" (3.3M parameters), stdlib corpus, AdamW "
           f"(lr {su['lr']}, betas 0.9/0.95, wd 0.1, warmup+cosine, clip 1.0), batch {su['batch']}x128 bytes, "
           f"N = {su['steps']} steps checkpointed, then K = {su['cont']} more. Full checkpoint = model + AdamW "
           f"state. Averages over steps 2..N.", ""]
    if result.get("pipeline"):
        out += ["## The table (real pipeline: Checkpointer + restore from storage)", "",
                f"Amber(threshold=τ) defaults otherwise; full_every={su['full_every']}, "
                f"batch_steps={su['batch_steps']}. *increment* = the selected elements of one step (encoded) / "
                "full; *written* = every object written during the loop (increments with loop state, merged "
                "increments, fulls) per step / full. Capture = training-thread time per step (the host "
                "snapshot copy); encode = writer-thread time per step.", "",
                "Restored: the latest step whose plan holds increments (step R, from the full at step F), "
                "compared with the exact state at R.", "",
                "| weights | τ | increment / full | (params / optimizer) | written / full per step | capture ms/step "
                "| step ms (no ckpt) | encode ms/step | fulls (early) / merged | restore R (F): objects, s "
                "| max rel err | stale elems | m / v err | held-out loss exact → restored "
                "| after K more steps exact → restored |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["pipeline"]:
            base = result["baseline"][r["dtype"]]
            out.append(
                f"| {r['dtype']} | {r['threshold']:g} | {_frac_pct(r['inc_frac'])} | {_frac_pct(r['param_frac'])} / "
                f"{_frac_pct(r['opt_frac'])} | {_frac_pct(r['written_frac'])} | {r['capture_ms']:.1f} | {r['step_ms']:.0f} "
                f"({1e3 * base['step_s']:.0f}) | {r['encode_ms']:.0f} | {r['fulls']} ({r['early_fulls']}) / "
                f"{r['merged_objects']} | {r['restore_step']} ({r['restore_full_step']}): {r['restore_objects']}, "
                f"{r['restore_s']:.2f} | {r['param_max_rel_err']:.4f} | {_frac_pct(r['param_stale_frac'])} | "
                f"{r['exp_avg_rel_l2_err']:.3f} / {r['exp_avg_sq_rel_l2_err']:.3f} | {r['loss_exact']:.4f} → "
                f"{r['loss_restored']:.4f} | {r['loss_exact_cont']:.4f} → {r['loss_restored_cont']:.4f} |")
        out.append("")
    if result.get("offline"):
        out += ["## Design choices (offline: the encoders side by side on one training run)", "",
                f"Fulls every {su['full_every']} steps; restored state at step N = the encoders' saved values "
                "(moments from the latest full under \"full schedule\"). m/v err = relative L2 error of "
                "exp_avg / exp_avg_sq. Round trip = encode object + decode + apply, per step.", "",
                "| weights | config | increment / full | params / optimizer | params written / param bytes "
                "| encode ms | round trip ms | max rel err | m err | v err | held-out exact → restored "
                "| after K steps exact → restored |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["offline"]:
            rt = f"{r['roundtrip_ms']:.0f}" if r.get("roundtrip_ms") is not None else ""
            out.append(
                f"| {r['dtype']} | {r['config']} | {_frac_pct(r['inc_frac'])} | {_frac_pct(r['param_frac'])} / "
                f"{_frac_pct(r['opt_frac'])} | {_frac_pct(r['param_frac_of_params'])} | {r['encode_ms']:.0f} | {rt} | "
                f"{r['param_max_rel_err']:.4f} | {r['exp_avg_rel_l2_err']:.4f} | {r['exp_avg_sq_rel_l2_err']:.4f} | "
                f"{r['loss_exact']:.4f} → {r['loss_restored']:.4f} | {r['loss_exact_cont']:.4f} → "
                f"{r['loss_restored_cont']:.4f} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="~30 steps per run instead of 150")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--parts", default="1,2", help="comma list: 1 = the table, 2 = design choices")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the training thread and the writer thread then "
                         "share the 2 cores without oversubscription)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    su = QUICK if args.quick else FULL
    parts = {int(p) for p in args.parts.split(",")}
    dtypes = args.dtypes.split(",")
    corpus = stdlib_corpus()
    data = ByteBatches(corpus, GPTConfig.preset(su.preset).seq, su.batch)
    result = {"mode": "quick" if args.quick else "full", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine(), "setup": asdict(su), "baseline": {}, "pipeline": [], "offline": []}
    t0 = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="amber_table_")
    try:
        if 1 in parts:
            for dn in dtypes:
                runs = []
                for thr in THRESHOLDS:
                    row, target, restored = pipeline_run(dn, thr, su, data, workdir)
                    runs.append((row, target, restored))
                    print(f"[{time.perf_counter() - t0:.0f}s] {dn} τ={thr}: increment {_frac_pct(row['inc_frac'])}, "
                          f"capture {row['capture_ms']:.1f} ms, restored step {target}", flush=True)
                exact = exact_run(dn, su, data, {t for _, t, _ in runs})
                result["baseline"][dn] = {"step_s": exact["step_s"]}
                for row, target, restored in runs:
                    ex = exact["at"][target]
                    row.update(loss_exact=ex["loss"], loss_exact_cont=ex["loss_cont"],
                               **state_errors(restored["params"], ex["state"]["params"], restored["moments"],
                                              ex["state"]["moments"]))
                    result["pipeline"].append(row)
                    print(f"    τ={row['threshold']}: held-out {row['loss_exact']:.4f} -> {row['loss_restored']:.4f}, "
                          f"after K {row['loss_exact_cont']:.4f} -> {row['loss_restored_cont']:.4f}", flush=True)
        if 2 in parts:
            for dn in dtypes:
                rows = offline_run(dn, su, data)
                result["offline"] += rows
                for r in rows:
                    print(f"[{time.perf_counter() - t0:.0f}s] {dn} {r['config']}: {_frac_pct(r['inc_frac'])}, "
                          f"cont loss {r['loss_restored_cont']:.4f} (exact {r['loss_exact_cont']:.4f})", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["seconds"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "amber_table.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "amber_table.md"), "w") as f:
        f.write(markdown(result) + "\n")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
