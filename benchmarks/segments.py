"""The report of a ``benchmarks.run`` result (orchestrator): medians and ratios per configuration, the targets,
the markdown tables, the PNG plot, the JSON file (shared pieces: :mod:`benchmarks.report`).

Definitions (per job and configuration, over every measured step of every round):

* ``median_step_s`` — median of the per-step wall times (rank 0; the ranks run in lockstep);
* ``mean_step_s`` — mean of them: periodic work (a save every 10 steps, a full checkpoint every
  ``full_every`` steps) shows here, not in the median;
* ``overhead_paired_median_pct`` / ``overhead_ci95_pct`` — per round, ``mean / mean(reference in the same
  round) - 1`` (amortized, what a whole run pays); its median over rounds and the 95% percentile-bootstrap
  interval (:func:`paired_median_ci`); ``overhead_thread_cpu_*`` / ``overhead_cpu_*`` the same with the training
  thread's CPU time per step and with the CPU of every process; ``overhead_pct`` — pooled means, no interval;
  ``vs_ddp_pct`` — mean against plain DDP without checkpointing;
* ``bytes_per_step`` — bytes persisted by the training loop's checkpoints (saves inside the loop, not the
  attach-time full) / loop steps; ``fraction_of_full`` — that over the bytes of a full checkpoint's tensors
  (model state_dict + optimizer state: AdamW, SGD momentum for the MLP);
* ``peak_rss_mb`` — RSS high-water mark of the checkpointing process (rank 0) during training, median over
  segments (reset at the start of each forked segment process);
* ``drain_s`` — time after the last step until every checkpoint taken is on storage (flush / wait).
"""
from __future__ import annotations

import json
import os

from benchmarks import configs
from benchmarks.report import (ci_bars, ci_verdict, error_lines, fmt, lowdiff_overhead_targets, machine_info, median,
                               nbytes, now, paired_median_ci, pct, pyplot, save_figure, target_lines, write_result)

REFERENCE_DDP = "none"


def summarize_config(segs: list[dict], cfg=None, settings: dict | None = None) -> dict:
    r0 = [s["ranks"][0] for s in segs]
    steps = [t for r in r0 for t in r["step_s"]]
    loop_steps = [len(r["step_s"]) + len(r.get("warmup_s", [])) for r in r0]
    every = getattr(cfg, "every", 1)
    out = {"segments": len(segs), "samples": len(steps),
           "median_step_s": median(steps), "mean_step_s": sum(steps) / len(steps) if steps else None,
           "round_means_s": {s["round"]: sum(r["step_s"]) / len(r["step_s"]) for s, r in zip(segs, r0)},
           "round_thread_cpu_s": {s["round"]: sum(r["thread_cpu_step_s"]) / len(r["thread_cpu_step_s"])
                                  for s, r in zip(segs, r0) if r.get("thread_cpu_step_s")},
           "round_cpu_s": {s["round"]: sum(x.get("cpu_s", 0) + x.get("aux_cpu_s", 0) for x in s["ranks"])
                           / len(s["ranks"][0]["step_s"]) for s in segs},
           "drain_s": median([r.get("drain_s") for r in r0]),
           "bytes_per_step": median([r.get("bytes_loop", 0) / n for r, n in zip(r0, loop_steps)]),
           "full_ckpt_bytes": median([r.get("full_ckpt_bytes") for r in r0]),
           "param_count": r0[0].get("param_count"),
           "cpu_per_step_s": median([sum(x.get("cpu_s", 0) + x.get("aux_cpu_s", 0) for x in sg["ranks"])
                                      / len(sg["ranks"][0]["step_s"]) for sg in segs]),
           "aux_cpu_per_step_s": median([sum(x.get("aux_cpu_s", 0) for x in sg["ranks"]) / len(sg["ranks"][0]["step_s"])
                                          for sg in segs]),
           "thread_cpu_median_s": median([t for r in r0 for t in r.get("thread_cpu_step_s", [])]),
           "loadavg_median": median([x for sg in segs for x in sg.get("loadavg", [])]),
           "peak_rss_mb": median([r.get("peak_rss_train", r.get("peak_rss")) for r in r0]),
           "peak_rss_all_ranks_mb": median([max(x.get("peak_rss_train", x.get("peak_rss", 0)) for x in s["ranks"])
                                             for s in segs])}
    for k in ("peak_rss_mb", "peak_rss_all_ranks_mb"):
        if out[k] is not None:
            out[k] = out[k] / (1 << 20)
    if every > 1:  # a periodic save: its size over its period (the window may hold more or fewer saves)
        per_save = [r.get("bytes_loop", 0) / r["saves"] for r in r0 if r.get("saves")]
        if per_save:
            out["bytes_per_step"] = median(per_save) / every
    if out["bytes_per_step"] is not None and out["full_ckpt_bytes"]:
        out["fraction_of_full"] = out["bytes_per_step"] / out["full_ckpt_bytes"]
    if any("diff_bytes" in r for r in r0):
        out["diff_bytes_per_step"] = median([r["diff_bytes"] / n for r, n in zip(r0, loop_steps) if "diff_bytes" in r])
        out["full_object_bytes"] = median([r.get("full_object_bytes") for r in r0])
        if all(r.get("attach_full_bytes") is not None for r in r0):  # fulls in the loop (with optimizer state)
            out["full_object_bytes"] = median([(r["full_bytes"] - r["attach_full_bytes"]) / r["in_loop_fulls"]
                                                for r in r0 if r.get("in_loop_fulls")])
        if out["full_ckpt_bytes"]:
            out["diff_fraction_of_full"] = out["diff_bytes_per_step"] / out["full_ckpt_bytes"]
        # one full per full_every steps (the window of a segment may hold more or fewer than that share)
        fe = (getattr(cfg, "full_every", None) or (settings or {}).get("full_every"))
        if fe and out.get("full_object_bytes") is not None:
            out["bytes_per_step"] = out["diff_bytes_per_step"] + out["full_object_bytes"] / fe
            if out["full_ckpt_bytes"]:
                out["fraction_of_full"] = out["bytes_per_step"] / out["full_ckpt_bytes"]
        stats = [r["stats"] for r in r0 if "stats" in r]
        if stats:
            n = [len(r["step_s"]) + len(r.get("warmup_s", [])) for r in r0 if "stats" in r]
            out["per_step_ms"] = {k: median([st.get(k, 0) / m * 1e3 for st, m in zip(stats, n)])
                                  for k in ("capture_seconds", "encode_seconds", "write_seconds", "stall_seconds")}
    if any("uncommitted_lag" in r for r in r0):
        lags = [x for r in r0 for x in r.get("uncommitted_lag", [])]
        if lags:
            out["uncommitted_lag_median"] = median(lags)
            out["uncommitted_lag_max"] = max(lags)
    gcs = [(r["gc_s"], r.get("gc_longest_s", 0.0), r.get("gc_collections", [0, 0, 0]), len(r["step_s"]))
           for r in r0 if r.get("gc_s") is not None and r["step_s"]]
    if gcs:   # rank 0's interpreter garbage collector over the measured steps
        out["gc_ms_per_step"] = median([g / n * 1e3 for g, _, _, n in gcs])
        out["gc_longest_ms"] = max(x for _, x, _, _ in gcs) * 1e3
        out["gc_collections_per_1000_steps"] = [median([c[i] / n * 1000 for _, _, c, n in gcs]) for i in range(3)]
    lags = [x for r in r0 for x in r.get("replica_lag", [])]
    if lags:
        lags.sort()
        out["replica_lag_p50"] = lags[len(lags) // 2]
        out["replica_lag_p99"] = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
    roles = [(r.get("aux_cpu_roles_s") or {}, len(r["step_s"])) for r in r0 if r.get("aux_cpu_roles_s")]
    if roles:
        out["actor_cpu_per_step_ms"] = {k: median([d[k] / n * 1e3 for d, n in roles if k in d and n])
                                        for k in sorted({k for d, _ in roles for k in d})}
    rec: dict[str, list] = {}
    for r in r0:
        for k, v in (r.get("recovery") or {}).items():
            rec.setdefault(k, []).append(v)
    if rec:
        out["recovery"] = {k: {"seconds": median([x["seconds"] for x in v]), "step": v[-1].get("step"),
                               "samples": [s for x in v for s in x.get("samples", [])]} for k, v in rec.items()}
    if segs[0].get("fit_s") is not None:
        out["fit_s"] = segs[0]["fit_s"]
    return out


def build(raw: dict, settings: dict, all_configs) -> dict:
    cfg_by_name = {c.name: c for c in all_configs}
    jobs_out = {}
    for job in [j for j in dict.fromkeys(s["job"] for s in raw["segments"])]:
        segs = [s for s in raw["segments"] if s["job"] == job]
        summ = {}
        for name in dict.fromkeys(s["config"] for s in segs):
            summ[name] = summarize_config([s for s in segs if s["config"] == name], cfg_by_name.get(name), settings)
        for name, s in summ.items():
            c = cfg_by_name[name]
            ref = summ.get(c.reference)
            s["reference"] = c.reference
            if ref and ref.get("mean_step_s"):
                s["overhead_pct"] = 100 * (s["mean_step_s"] / ref["mean_step_s"] - 1)
                # paired rounds: each round's configuration against its reference in the same round; the
                # estimator is the median over rounds with a bootstrap CI (wall time, all-process CPU, and the
                # training thread's CPU: the critical path, least disturbed by other work on the machine)
                for basis, key in (("", "round_means_s"), ("_cpu", "round_cpu_s"),
                                   ("_thread_cpu", "round_thread_cpu_s")):
                    mine, theirs = s.get(key) or {}, ref.get(key) or {}
                    paired = [100 * (mine[r] / theirs[r] - 1) for r in mine if r in theirs and theirs[r]]
                    s[f"overhead{basis}_paired_rounds_pct"] = paired
                    est = paired_median_ci(paired)
                    if est is not None:
                        s[f"overhead{basis}_paired_median_pct"] = est[0]
                        s[f"overhead{basis}_ci95_pct"] = list(est[1])
                if ref.get("cpu_per_step_s") and s.get("cpu_per_step_s") is not None:
                    s["overhead_cpu_pct"] = 100 * (s["cpu_per_step_s"] / ref["cpu_per_step_s"] - 1)
                if ref.get("thread_cpu_median_s") and s.get("thread_cpu_median_s") is not None:
                    s["overhead_thread_cpu_pct"] = 100 * (s["thread_cpu_median_s"] / ref["thread_cpu_median_s"] - 1)
            ddp = summ.get(REFERENCE_DDP)
            if ddp and ddp.get("mean_step_s") and c.launcher == "mp":
                s["vs_ddp_pct"] = 100 * (s["mean_step_s"] / ddp["mean_step_s"] - 1)
            if ref and s.get("peak_rss_mb") is not None and ref.get("peak_rss_mb") is not None:
                s["extra_rss_mb"] = s["peak_rss_mb"] - ref["peak_rss_mb"]
            lost = [f for f in raw["failures"] if f["job"] == job and f["config"] == name]
            if lost:
                s["steps_lost"] = [f["lost"] for f in lost]
                s["crash_trials"] = lost
        jobs_out[job] = {"configs": summ, "targets": targets(summ)}
        est = full_cost_estimate(summ, settings)
        if est:
            jobs_out[job]["lowdiff_full_cost_estimate"] = est
    return {"date": now(),
            "machine": machine_info(settings.get("device", "auto")), "settings": settings, "jobs": jobs_out,
            "errors": raw["errors"], "wall_s": raw["wall_s"], "raw": {"segments": raw["segments"],
                                                                      "failures": raw["failures"]},
            "definitions": __doc__}


def full_cost_estimate(summ: dict, settings: dict) -> dict | None:
    """Split LowDiff top-k's measured overhead into a per-diff-step part (``lowdiff_topk_nofull``: no full in the
    measured window) and the cost of one full checkpoint (``lowdiff_topk`` has exactly one in its window of
    ``steps`` steps), then re-amortize the full over other periods: ``(d + f / F) / reference step``. An
    estimate from differences of noisy means; the measured figure is ``lowdiff_topk``'s own overhead."""
    ld, nf, ref = summ.get("lowdiff_topk"), summ.get("lowdiff_topk_nofull"), summ.get("topk_none")
    if not (ld and nf and ref and ref.get("mean_step_s")):
        return None
    steps, fe = settings["steps"], settings["full_every"]
    if not settings["warmup"] < fe <= settings["warmup"] + steps:
        return None  # the full does not fall inside the measured window
    t = ref["mean_step_s"]
    d = nf["mean_step_s"] - t                           # seconds per diff step
    f = (ld["mean_step_s"] - nf["mean_step_s"]) * steps  # seconds per full checkpoint (one per window)
    at = {str(F): 100 * (d + f / F) / t for F in (fe, 50, 100)}
    return {"diff_step_overhead_pct": 100 * d / t, "full_cost_s": f, "full_cost_steps": f / t,
            "overhead_pct_at": at}


def targets(summ: dict) -> dict:
    """The issues' targets on the measured figures, each judged on a 95% confidence interval (median of the
    paired rounds, bootstrap): ``met`` / ``missed`` only when the whole interval is on one side of the limit, else
    ``inconclusive`` — never on a point estimate."""
    t = {}
    ld = summ.get("lowdiff_topk")
    if ld:
        for basis, key in (("wall", "overhead"), ("train_thread_cpu", "overhead_thread_cpu"),
                           ("cpu", "overhead_cpu")):
            ci = ld.get(f"{key}_ci95_pct")
            if ci is None:
                continue
            t.update(lowdiff_overhead_targets(basis, ld[f"{key}_paired_median_pct"], ci,
                                              len(ld[f"{key}_paired_rounds_pct"]), width=basis != "cpu"))
            for other in ("torch_save_1", "dcp_async"):
                oci = (summ.get(other) or {}).get(f"{key}_ci95_pct")
                if oci is None:
                    continue
                lo = oci[0] / max(ci[1], 0.1)       # the least favourable reading of both intervals
                hi = oci[1] / max(ci[0], 0.1)       # the most favourable
                t[f"10x_less_than_{other}_{basis}"] = {
                    "baseline_ci95_pct": oci, "lowdiff_ci95_pct": ci, "ratio_low": lo, "ratio_high": hi,
                    "verdict": "met" if lo >= 10 else ("missed" if hi < 10 else "inconclusive")}
        if "diff_fraction_of_full" in ld:
            t["bytes_per_step_le_1pct"] = {"diff_only_pct": 100 * ld["diff_fraction_of_full"],
                                           "with_fulls_pct": 100 * ld.get("fraction_of_full", float("nan")),
                                           "verdict": "met" if ld["diff_fraction_of_full"] <= 0.01 else "missed"}
    # fast steps: checkpointing every step costs <= 25% dense, <= 10% top-k (paired-round 95% CI)
    for name, limit in (("lowdiff_dense", 25.0), ("lowdiff_dense_ray", 25.0), ("lowdiff_dense_ray_fulls", 25.0),
                        ("lowdiff_topk", 10.0), ("lowdiff_topk_ray", 10.0)):
        s = summ.get(name)
        if s and s.get("overhead_ci95_pct"):
            t[f"{name}_overhead_le_{limit:.0f}pct_ci95"] = {
                "median_pct": s["overhead_paired_median_pct"], "ci95_pct": s["overhead_ci95_pct"],
                "verdict": ci_verdict(s["overhead_ci95_pct"], limit)}
    lr = summ.get("lowdiff_topk_ray")
    rec = (lr or {}).get("recovery") or {}
    for point in ("latest", "chain", "full"):
        m, d = rec.get(f"memory_{point}"), rec.get(f"durable_{point}")
        if m and d and m["seconds"]:
            sp = d["seconds"] / m["seconds"]
            t[f"memory_vs_durable_{point}"] = {"speedup": sp, "memory_s": m["seconds"], "durable_s": d["seconds"],
                                               "verdict": "met" if sp >= 3 else "missed"}
    # the state tier: the latest step from the replica >= 10x faster than the durable chain, within 3x of one copy
    m, d, cp = rec.get("memory_latest"), rec.get("durable_latest"), rec.get("copy_state")
    if m and d and cp and m["seconds"]:
        t["replica_latest_vs_durable_chain"] = {"speedup": d["seconds"] / m["seconds"], "replica_s": m["seconds"],
                                                "durable_s": d["seconds"],
                                                "verdict": "met" if d["seconds"] / m["seconds"] >= 10 else "missed"}
        t["replica_latest_vs_one_copy"] = {"ratio": m["seconds"] / cp["seconds"], "copy_s": cp["seconds"],
                                           "verdict": "met" if m["seconds"] / cp["seconds"] <= 3 else "missed"}
    lost = (lr or {}).get("steps_lost")
    if lost:
        t["lowdiff_ray_steps_lost_le_1"] = {"lost": lost, "verdict": "met" if max(lost) <= 1 else "missed"}
    return t


def markdown(result: dict, all_configs) -> str:
    m, st = result["machine"], result["settings"]
    labels = {c.name: c.label for c in all_configs}
    lines = [f"# ray_ckpt benchmark — mode `{st['mode']}`", "",
             f"- date: {result['date']}",
             f"- machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('mem_gb', '?')} GB RAM"
             + (f"; GPU {m['gpu']} x{m.get('gpu_count')} (CUDA {m.get('cuda')}, NCCL {m.get('nccl')})" if m.get("gpu") else "; no GPU"),
             f"- software: torch {m.get('torch')}, ray {m.get('ray')}, ray_ckpt {m.get('ray_ckpt')}, "
             f"Python {m.get('python')}",
             f"- setup: {st['world']} data-parallel processes x {st['threads']} torch thread(s), device "
             f"`{st['device']}`; {st['rounds']} interleaved round(s) of {st['warmup']} warm-up + {st['steps']} measured "
             f"steps per configuration; top-k ratio {st['topk_ratio']}; LowDiff/Amber full every {st['full_every']} "
             f"steps, {st['batch_steps']} steps per diff object; Ray Train poll "
             f"(RAY_TRAIN_HEALTH_CHECK_INTERVAL_S) {st['raytrain_poll_s']} s (Ray's default: 2 s)",
             f"- wall time: {result['wall_s'] / 60:.1f} min", ""]
    for name, why in st.get("skipped", {}).items():
        lines.append(f"- **{name}**: {why}")
    for job, j in result["jobs"].items():
        c = j["configs"]
        any_c = next(iter(c.values()))
        lines += ["", f"## {job}: {any_c.get('param_count', 0) / 1e6:.2f}M parameters, full checkpoint "
                      f"(model + optimizer state) {nbytes(any_c.get('full_ckpt_bytes'))}", "",
                  f"Load average during this job: median {fmt(median([x.get('loadavg_median') for x in c.values()]), '.1f')} "
                  f"on {m.get('cores')} cores (other work on the machine adds noise to wall times; the CPU columns "
                  "are less sensitive to it).", "",
                  "| configuration | reference | step ms (median) | overhead, wall (median of paired rounds) "
                  "| 95% CI | train-thread CPU overhead | 95% CI | CPU/step overhead (all processes) | 95% CI "
                  "| overhead (mean step, all rounds pooled) | vs plain DDP | bytes/step | % of full | peak RSS rank 0 "
                  "| drain s | steps lost |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, s in c.items():
            lost = s.get("steps_lost")
            own = name == s["reference"]
            ref_label = labels.get(s['reference'], s['reference']) if not own else '—'

            def ci(key):
                v = s.get(key)
                return "–" if own or not v else "[%+.1f, %+.1f]%%" % tuple(v)

            lines.append(
                f"| {labels.get(name, name)} | {ref_label} | {fmt(s['median_step_s'] * 1e3)} "
                f"| {'–' if own else pct(s.get('overhead_paired_median_pct'))} | {ci('overhead_ci95_pct')} "
                f"| {'–' if own else pct(s.get('overhead_thread_cpu_paired_median_pct'))} "
                f"| {ci('overhead_thread_cpu_ci95_pct')} "
                f"| {'–' if own else pct(s.get('overhead_cpu_paired_median_pct'))} | {ci('overhead_cpu_ci95_pct')} "
                f"| {pct(s.get('overhead_pct'))} | {pct(s.get('vs_ddp_pct'))} "
                f"| {nbytes(s.get('bytes_per_step'))} | {fmt(100 * s['fraction_of_full'] if 'fraction_of_full' in s else None, '.2f')} "
                f"| {fmt(s.get('peak_rss_mb'), '.0f')} MB | {fmt(s.get('drain_s'), '.2f')} "
                f"| {', '.join(map(str, lost)) if lost else '–'} |")
        extra = []
        for name, s in c.items():
            if "diff_bytes_per_step" in s:
                extra.append(f"- {labels.get(name, name)}: diffs alone {nbytes(s['diff_bytes_per_step'])}/step = "
                             f"{100 * s['diff_fraction_of_full']:.2f}% of a full checkpoint; with one full "
                             f"({nbytes(s.get('full_object_bytes'))} encoded) every {st['full_every']} steps "
                             f"{100 * s.get('fraction_of_full', 0):.2f}%"
                             + (f"; per step: capture {s['per_step_ms']['capture_seconds']:.2f} ms (training thread), "
                                f"encode {s['per_step_ms']['encode_seconds']:.2f} ms + write "
                                f"{s['per_step_ms']['write_seconds']:.2f} ms (background), stall "
                                f"{s['per_step_ms']['stall_seconds']:.2f} ms" if s.get("per_step_ms") else ""))
            if "replica_lag_p50" in s or "actor_cpu_per_step_ms" in s:
                cpu = s.get("actor_cpu_per_step_ms") or {}
                extra.append(f"- {labels.get(name, name)}: state-tier replica lag (steps behind the trainer, sampled "
                             f"twice a second) p50 {s.get('replica_lag_p50', '–')} / p99 {s.get('replica_lag_p99', '–')}; "
                             "CPU per training step of the ray_ckpt actors: "
                             + (", ".join(f"{k} {v:.1f} ms" for k, v in cpu.items()) or "–"))
            if "uncommitted_lag_median" in s:
                extra.append(f"- {labels.get(name, name)}: steps since the newest checkpoint handed to the Ray Train "
                             f"controller, at each step end: median {s['uncommitted_lag_median']}, max "
                             f"{s['uncommitted_lag_max']} (a crash loses at least this many; committed only at the "
                             f"next poll); fit() {fmt(s.get('fit_s'))} s incl. worker start-up")
        gc_rows = [(name, s) for name, s in c.items() if s.get("gc_ms_per_step") is not None]
        if gc_rows:
            extra.append("- Python garbage collector in rank 0 over the measured steps (per step; collections of "
                         "generations 0/1/2 per 1000 steps; longest pause): "
                         + "; ".join(f"{labels.get(n, n)} {s['gc_ms_per_step']:.3f} ms "
                                     f"({'/'.join(f'{x:.0f}' for x in s['gc_collections_per_1000_steps'])}; "
                                     f"{s['gc_longest_ms']:.1f} ms)" for n, s in gc_rows))
        est = j.get("lowdiff_full_cost_estimate")
        if est:
            at = est["overhead_pct_at"]
            extra.append(f"- LowDiff top-k, split (estimate from the two LowDiff rows): a diff step costs "
                         f"{est['diff_step_overhead_pct']:+.1f}% of a step, one full checkpoint {est['full_cost_s']:.2f} s "
                         f"(= {est['full_cost_steps']:.2f} steps); amortized overhead with a full every "
                         + ", ".join(f"{F} steps: {v:+.1f}%" for F, v in at.items()))
        if extra:
            lines += [""] + extra
        rec_rows = []
        for name, s in c.items():
            for k, v in (s.get("recovery") or {}).items():
                rec_rows.append(f"| {labels.get(name, name)} | {k.replace('_', ' ')} | {v.get('step')} "
                                f"| {v['seconds']:.3f} |")
        if rec_rows:
            lines += ["", "Recovery (fresh model + optimizer, restore, load_state_dict; median). LowDiff points: "
                          "*latest* = last step, *chain* = the step before the in-loop full (longest replay, "
                          f"{st['full_every'] - 1} diffs), *full* = a full-checkpoint step (no replay). *memory* = "
                          "restore(runtime='ray') from the object store, *durable* = from storage (local disk, "
                          "page cache warm).", "",
                      "| configuration | what | step | seconds |", "|---|---|---:|---:|"] + rec_rows
        if j["targets"]:
            lines += ["", "Targets:", ""]
            lines += target_lines(j["targets"])
    lines += error_lines(result["errors"])
    lines += ["", "Definitions: *overhead, wall* = per round, the configuration's mean wall time per measured step "
                  "against its reference's mean in the same round, minus 1 (amortized: periodic saves, fulls and "
                  "spill-over of background work included); the figure is the median over rounds and the *95% CI* "
                  "its percentile bootstrap (10,000 resamples of the rounds). *Train-thread CPU* = the same with the "
                  "training thread's CPU time per step (time.thread_time: the critical path, least disturbed by "
                  "other work on the machine). *CPU/step* = the same with the CPU seconds of every training process "
                  "(all threads) plus the ray_ckpt actors (runtime='ray'), from the first measured step through the "
                  "drain. *Overhead (mean step, pooled)* = mean over every measured step of every round against the "
                  "reference's (no interval). *vs plain DDP* = mean step against DDP without compression or "
                  "checkpointing. *Bytes/step* = bytes the loop's checkpoints persisted / loop steps. *Steps lost* = "
                  "step reached when rank 0 was SIGKILLed - step a fresh process restored (0 = nothing committed: "
                  "start over)."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str, all_configs) -> None:
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    labels = {c.name: c.label for c in all_configs}
    ours = ("lowdiff", "amber")
    jobs = list(result["jobs"])
    if not jobs:   # every segment failed: say so in the figure rather than fail to draw one (the errors are in
        fig = plt.figure(figsize=(8, 2))   # the JSON and the markdown)
        fig.text(0.5, 0.5, f"no segment completed ({len(result.get('errors') or [])} errors: see bench_*.md)",
                 ha="center", va="center")
        save_figure(fig, path)
        return
    fig, axes = plt.subplots(len(jobs), 2, figsize=(16, 1.8 + 4.6 * len(jobs)), squeeze=False)
    for row, job in enumerate(jobs):
        c = result["jobs"][job]["configs"]
        names = [n for n in c if c[n]["reference"] != n]
        y = list(range(len(names)))[::-1]
        ax = axes[row][0]
        mean = [c[n].get("overhead_paired_median_pct", c[n].get("overhead_pct")) or 0.0 for n in names]
        colors = ["tab:green" if n.startswith(ours) else ("tab:gray" if n == "topk_none" else "tab:red")
                  for n in names]
        cis = [c[n].get("overhead_ci95_pct") or [m, m] for n, m in zip(names, mean)]
        ci_bars(ax, mean, cis, horizontal=True, color=colors, alpha=0.75,
                error_kw={"ecolor": "black", "capsize": 3, "lw": 0.9})
        med = [c[n].get("overhead_thread_cpu_paired_median_pct") or 0.0 for n in names]
        cpu = [c[n].get("overhead_cpu_paired_median_pct", c[n].get("overhead_cpu_pct")) or 0.0 for n in names]
        ax.scatter(med, y, color="black", marker="|", s=220, zorder=3)
        ax.scatter(cpu, y, color="tab:blue", marker="D", s=22, zorder=3)
        for yi, v in zip(y, mean):
            ax.annotate(f"{v:+.1f}%", (v, yi), xytext=(6 if v >= 0 else -6, 7), textcoords="offset points",
                        va="center", ha="left" if v >= 0 else "right", fontsize=8)
        mean = mean + [x for ci in cis for x in ci]   # the axis limits include the intervals
        ax.set_xscale("symlog", linthresh=2.0, linscale=0.6)
        ax.set_yticks(y)
        ax.set_yticklabels([f"{labels.get(n, n)}\nvs {labels.get(c[n]['reference'], c[n]['reference'])}"
                            for n in names], fontsize=8)
        ax.axvline(0, color="black", lw=0.8)
        ax.axvline(1.0, color="tab:green", ls=":", lw=0.8)
        ax.set_xlabel("overhead vs reference, % (symlog: linear within ±2%)")
        ax.set_title(f"{job}: step-time overhead")
        ax.grid(axis="x", alpha=0.3)
        lo_x = min([0.0] + mean + med + cpu)
        hi_x = max([5.0] + mean + med + cpu)
        ticks = [t for t in (-100, -50, -20, -10, -5, -2, 0, 2, 5, 10, 20, 50, 100, 500, 1000, 5000)
                 if lo_x * 1.05 - 1 <= t <= hi_x * 1.05 + 1]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}%" for t in ticks], fontsize=8)
        ax.set_xlim(min(lo_x * 1.6, -1.0), hi_x * 2.5)
        ax = axes[row][1]
        bnames = [n for n in names if c[n].get("bytes_per_step")]
        yb = list(range(len(bnames)))[::-1]
        frac = [100 * c[n].get("fraction_of_full", 0) for n in bnames]
        ax.barh(yb, frac, color=["tab:green" if n.startswith(ours) else "tab:red" for n in bnames], alpha=0.75)
        diff = [(yi, 100 * c[n]["diff_fraction_of_full"]) for yi, n in zip(yb, bnames) if "diff_fraction_of_full" in c[n]]
        if diff:
            ax.scatter([d for _, d in diff], [yi for yi, _ in diff], color="black", marker="o", s=18, zorder=3)
        for yi, n, v in zip(yb, bnames, frac):
            ax.annotate(f"{nbytes(c[n]['bytes_per_step'])}/step = {v:.3g}%", (v, yi), xytext=(5, 0),
                        textcoords="offset points", va="center", fontsize=8)
        ax.set_xscale("log")
        ax.set_yticks(yb)
        ax.set_yticklabels([labels.get(n, n) for n in bnames], fontsize=8)
        ax.axvline(1.0, color="tab:blue", ls="--", lw=0.8)
        ax.set_xlabel("bytes persisted per step, % of a full checkpoint (model + optimizer state), log scale")
        full = next(iter(c.values())).get("full_ckpt_bytes")
        ax.set_title(f"{job}: bytes per step (a full checkpoint = {nbytes(full)})")
        ax.grid(axis="x", alpha=0.3, which="major")
        lo = min(frac + [d for _, d in diff] + [1.0]) / 3 if frac else 0.1
        ax.set_xlim(lo, max(frac + [100.0]) * 15)

    fig.legend(handles=[Patch(color="tab:red", alpha=0.75, label="baseline: wall overhead (median of paired rounds, 95% CI)"),
                        Patch(color="tab:green", alpha=0.75, label="ray_ckpt: wall overhead (median of paired rounds, 95% CI)"),
                        Patch(color="tab:gray", alpha=0.75, label="top-k compression itself (vs plain DDP)"),
                        Line2D([], [], color="black", marker="|", ls="", markersize=12, label="training-thread CPU"),
                        Line2D([], [], color="tab:blue", marker="D", ls="", markersize=5,
                               label="CPU per step (all processes + ray_ckpt actors)"),
                        Line2D([], [], color="tab:green", ls=":", label="1% target")],
               fontsize=8, loc="lower center", bbox_to_anchor=(0.27, 0.0), ncol=3, frameon=False)
    fig.legend(handles=[Patch(color="tab:green", alpha=0.75, label="ray_ckpt (diffs + its periodic fulls)"),
                        Patch(color="tab:red", alpha=0.75, label="baselines"),
                        Line2D([], [], color="black", marker="o", ls="", markersize=4, label="ray_ckpt diffs alone"),
                        Line2D([], [], color="tab:blue", ls="--", label="1% target")],
               fontsize=8, loc="lower center", bbox_to_anchor=(0.76, 0.0), ncol=2, frameon=False)
    m = result["machine"]
    st = result["settings"]
    fig.suptitle(f"ray_ckpt benchmark ({st['mode']}), {result['date'][:10]}: {m.get('cpu')}, {m.get('cores')} cores"
                 + (f", {m['gpu']}" if m.get("gpu") else ", CPU only") + f"; torch {m.get('torch')}, ray {m.get('ray')}; "
                 f"{st['world']} DDP ranks, {st['rounds']} rounds x {st['steps']} steps, full every {st['full_every']}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.3 / len(jobs) * 0.35 + 0.02, 1, 1))
    save_figure(fig, path)


def write_all(result: dict, out_dir: str, mode: str) -> list[str]:
    """``bench_<mode>.json`` / ``.md`` / ``.png`` in ``out_dir``; the paths."""
    return write_result(os.path.join(out_dir, f"bench_{mode}"), result, lambda r: markdown(r, configs.CONFIGS),
                        lambda r, path: plot(r, path, configs.CONFIGS), echo=False)


def rebuild(path: str, out_dir: str | None = None) -> list[str]:
    """Rebuild the summary, markdown and plot of a ``bench_<mode>.json`` from the raw samples it saved (e.g. after
    changing the report), into ``out_dir`` (default: the JSON's folder); the paths written."""
    with open(path) as f:
        old = json.load(f)
    raw = {"segments": old["raw"]["segments"], "failures": old["raw"]["failures"], "errors": old["errors"],
           "wall_s": old["wall_s"]}
    result = build(raw, old["settings"], configs.CONFIGS)
    result["date"], result["machine"] = old["date"], old["machine"]
    return write_all(result, out_dir or os.path.dirname(os.path.abspath(path)), old["settings"]["mode"])
