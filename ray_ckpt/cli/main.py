"""``ray-ckpt``: inspect, verify, export and garbage-collect a checkpoint lineage on storage. Engine + lineage +
storage only: no cluster, no model code needed. Runs in the calling process.

    ray-ckpt ls URI                 generations, objects and the recoverable steps
    ray-ckpt inspect URI [--step S] [--plot FILE]
                                    the recovery plan for a step (default: the latest) and the adaptive
                                    policy's latest decision with its reason; --plot draws the lineage
    ray-ckpt verify URI             read every committed object, check size, checksum and structure
    ray-ckpt export URI OUT [--step S] [--format safetensors|dcp|torch]
                                    materialize a step (full + replay, no model code) into the directory OUT
    ray-ckpt restore URI OUT [--step S]
                                    the same as ``export --format torch`` (OUT/checkpoint.pt: model, optimizer,
                                    scheduler/RNG/extra state as torch.save'd dicts)
    ray-ckpt gc URI --keep-fulls K [--dry-run]
                                    delete chains older than the K newest full checkpoints
    ray-ckpt lease URI [--release]  which job writes the lineage (each rank's of a sharded root); --release frees the lease of a job that is gone

The root of sharded (FSDP2) state (``shards/w<W>/r<R>/``: a lineage per rank) works with every command: ``ls``
shows each rank's head and the step complete on every rank; ``inspect`` the plan of each rank for that step;
``verify`` reads every rank's objects; ``export``/``restore`` gather the ranks' shards into the unsharded state;
``gc`` collects every rank's lineage without breaking a step that is complete on every rank from its cutoff on.

Long commands show progress bars on a terminal (``-q`` silences them).

Storage options (S3 endpoint, credentials) are given as ``-o key=value`` (repeatable) or in the URI's query.
Exit status: 0 on success, 1 when verification finds a corrupt object or nothing is recoverable, 2 on usage.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ray_ckpt.engine import amber_tier
from ray_ckpt.engine import export as _export
from ray_ckpt.engine import gc as _gc
from ray_ckpt.engine import consolidate, shard_chains, shard_layout
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine.restore import read_object
from ray_ckpt.engine.strategy import impl_by_name
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.format.container import CorruptObjectError
from ray_ckpt.lineage import ManifestError, NoCheckpointError
from ray_ckpt.lineage import drains as drain_records
from ray_ckpt.lineage.layout import TIER_DIR
from ray_ckpt.policy.adaptive import read_report
from ray_ckpt.storage import StorageError, open_storage


def _options(pairs: list[str]) -> dict:
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise SystemExit(f"ray-ckpt: storage option {p!r} is not key=value")
        k, v = p.split("=", 1)
        out[k] = v
    return out


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "-"
    out, start, prev = [], steps[0], steps[0]
    for s in steps[1:] + [None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        out.append(f"{start}" if start == prev else f"{start}..{prev}")
        if s is not None:
            start = prev = s
    return ", ".join(out)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _sharded_summary(storage) -> list[dict]:
    """Per saved world size of sharded (FSDP2) state: the step complete on every rank and each rank's head."""
    out = []
    for world in shard_layout.saved_worlds(storage):
        lins = [load_lineage(shard_layout.shard_storage(storage, world, r), strict=False)[0] for r in range(world)]
        out.append({"world": world, "latest": shard_chains.agreed_step(lins, None),
                    "ranks": [{"rank": r, "head": lin.head(),
                               "uri": shard_layout.shard_storage(storage, world, r).uri}
                              for r, lin in enumerate(lins)]})
    return out


def _durable_mode(ms: list) -> str:
    """The ``durable_diffs`` a generation was written with (recorded in its trainer's manifests)."""
    modes = {m.info.get("durable_diffs") for m in ms}
    return "amber" if "amber" in modes else "fulls" if "fulls" in modes else "all"


def _granularity(fulls: list) -> dict | None:
    """What the overhead budget chose for a generation, from its fulls' manifests (``info["recovery_every"]``,
    ``info["unrecorded_from"]``): None when every step was recorded."""
    marked = [m for m in fulls if isinstance(m.info.get("unrecorded_from"), int)]
    if not marked:
        return None
    last = max(marked, key=lambda m: m.last_step)
    return {"k": last.info.get("recovery_every"), "since": min(m.info["unrecorded_from"] for m in marked) - 1,
            "unrecorded": sum(max(0, m.last_step - m.info["unrecorded_from"]) for m in marked)}


def cmd_ls(storage, args) -> int:
    lineage, bad = load_lineage(storage, strict=False)
    tier = amber_tier.tier_manifests(storage)
    tier_reach = amber_tier.tier_steps(lineage, tier) if tier else {}
    rows = []
    for gen in lineage.generations:
        ms = [m for m in lineage.manifests if m.generation == gen]
        fulls = [m for m in ms if m.kind == "full"]
        diffs = [m for m in ms if m.kind == "diff"]
        steps = lineage.reachable_steps(gen)
        lazy = _durable_mode(ms) != "all"
        rows.append({"generation": gen, "fulls": [m.last_step for m in fulls], "diff_objects": len(diffs),
                     "full_bytes": sum(m.nbytes for m in fulls), "diff_bytes": sum(m.nbytes for m in diffs),
                     "recoverable": _ranges(steps), "strategy": sorted({m.strategy for m in ms}),
                     # durable_diffs="fulls": steps between fulls are not in storage by design (not a gap)
                     "gaps": "-" if lazy else _ranges(lineage.uncovered_steps(gen)),
                     "durable_diffs": _durable_mode(ms), "granularity": _granularity(fulls)})
        incs = [m for m in tier if m.generation == gen]
        if incs:
            rows[-1]["amber_tier"] = {"increments_objects": len(incs), "bytes": sum(m.nbytes for m in incs),
                                      "restorable": _ranges(tier_reach.get(gen, [])),
                                      "bound": amber_tier.bound_text(incs[-1])}
    head = lineage.head()
    shards = _sharded_summary(storage)
    drains = drain_records.read_records(storage)
    if not lineage.manifests and not bad and not shards and not args.json:
        print(f"ray-ckpt: no checkpoint lineage at {storage.describe()} (nothing committed there)",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"uri": storage.describe(), "head": head, "generations": rows,
                          "malformed_manifests": bad, "sharded": shards, "drains": drains}, indent=2))
        return 0
    for w in shards:
        print(f"{storage.describe()}: sharded state (FSDP2) of {w['world']} ranks: latest step complete on every "
              f"rank {w['latest']}")
        for r in w["ranks"]:
            print(f"  rank {r['rank']}: latest recoverable step {r['head']}  (ray-ckpt ls {r['uri']})")
    if not lineage.manifests and not bad:
        return 0
    tier_head = max(((g, st[-1]) for g, st in tier_reach.items()), default=None)
    newer = tier_head is not None and (head is None or tier_head > (lineage.generations[-1], head))
    print(f"{storage.describe()}: latest recoverable step {head}"
          + (f" (exact); {tier_head[1]} from the Amber tier, within its bound" if newer else ""))
    for r in rows:
        print(f"  generation {r['generation']} ({', '.join(r['strategy'])}): fulls at {r['fulls']}, "
              f"{r['diff_objects']} diff objects; {_human(r['full_bytes'])} full + {_human(r['diff_bytes'])} "
              f"diffs; recoverable steps {r['recoverable']}"
              + (f"; GAP (lost steps) {r['gaps']}" if r["gaps"] != "-" else ""))
        g = r["granularity"]
        if g is not None:
            print(f"    overhead budget: recovery points every {g['k']} steps (fulls) since step {g['since']}, "
                  f"{g['unrecorded']} steps left unrecorded by choice, not lost (lost-work bound {g['k']} steps)")
        if r["durable_diffs"] in ("fulls", "amber"):
            print(f"    durable_diffs={r['durable_diffs']}: storage holds the fulls (and diffs written on flush, under "
                  "memory pressure or after a node loss); other steps restore exactly only from the memory tier "
                  "of the running cluster (Checkpointer.stats()['runtime']['restorable'])")
        a = r.get("amber_tier")
        if a:
            print(f"    Amber tier ({TIER_DIR}): {a['increments_objects']} objects, {_human(a['bytes'])}; "
                  f"restorable from storage within the bound ({a['bound']}): steps {a['restorable']}")
    for rec in drains:   # node drains (preemption notices) the run's coordinator saw, and what they cost
        print(f"  {drain_records.describe(rec)}")
    for key in bad:
        print(f"  malformed manifest ignored: {key}")
    return 0 if head is not None else 1


def cmd_inspect(storage, args) -> int:
    if consolidate.consolidates(storage):
        return _inspect_sharded(storage, args)
    lineage, _ = load_lineage(storage, strict=False)
    if args.plot:
        from ray_ckpt.cli.plot import plot_lineage
        drawn = plot_lineage(lineage, args.plot, storage.describe())
        print(f"wrote {args.plot}: {drawn['generations']} generations, {drawn['fulls']} fulls, "
              f"{drawn['diffs']} diff objects, {drawn['gap_steps']} lost steps", file=sys.stderr)
    plan = amber_tier.plan(storage, lineage, args.step)   # what restore reads: the Amber tier only where needed
    tier = "amber" if plan is not None else "exact"
    if plan is None:
        try:
            plan = lineage.resolve(args.step)
        except NoCheckpointError as e:
            print(f"ray-ckpt: {e}", file=sys.stderr)
            return 1
    out = {"step": plan.step, "generation": plan.generation, "tier": tier,
           "read": [{"object": (TIER_DIR if m.info.get("tier") == amber_tier.TIER else "") + m.object,
                     "kind": m.kind, "steps": [m.first_step, m.last_step],
                     "bytes": m.nbytes, "strategy": m.strategy} for m in plan.objects]}
    if tier == "amber":
        out["bound"] = amber_tier.bound_text(plan.diffs[-1])
    policy = read_report(storage)
    if policy is not None:
        out["policy"] = policy
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"step {plan.step} (generation {plan.generation}): read {len(plan.objects)} objects, "
              f"{_human(sum(m.nbytes for m in plan.objects))}"
              + (f"; from the Amber tier, within {out['bound']} (the exact records are not in storage)"
                 if tier == "amber" else ""))
        for r in out["read"]:
            print(f"  {r['object']}  {r['kind']} steps {r['steps'][0]}..{r['steps'][1]}  {_human(r['bytes'])}")
        if policy is not None:
            pinned = f" (pinned: {', '.join(policy['pinned'])})" if policy.get("pinned") else ""
            print(f"policy: full_every={policy.get('full_every')} batch_steps={policy.get('batch_steps')}{pinned}, "
                  f"{policy.get('failures_seen', 0)} failures seen")
            print(f"  why: {policy.get('reason', '-')}")
    return 0


def _inspect_sharded(storage, args) -> int:
    """``inspect`` of a sharded root: the step a restore or export gathers and what each rank's lineage reads."""
    try:
        world, steps = shard_chains.choose_world(storage, args.step, strict=False)
    except NoCheckpointError as e:
        print(f"ray-ckpt: {e}", file=sys.stderr)
        return 1
    step = steps[0]
    ranks = []
    for r in range(world):
        lin, _ = load_lineage(shard_layout.shard_storage(storage, world, r), strict=False)
        plan = lin.resolve(step)
        prefix = shard_layout.shard_prefix(world, r)
        ranks.append({"rank": r, "generation": plan.generation,
                      "read": [{"object": prefix + m.object, "kind": m.kind, "steps": [m.first_step, m.last_step],
                                "bytes": m.nbytes, "strategy": m.strategy} for m in plan.objects]})
    nbytes = sum(o["bytes"] for r in ranks for o in r["read"])
    out = {"step": step, "sharded": True, "world": world, "tier": "exact", "bytes": nbytes, "ranks": ranks}
    if args.plot:
        print(f"ray-ckpt: --plot draws one lineage: give it a rank's, e.g. "
              f"{shard_layout.shard_storage(storage, world, 0).uri}", file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"step {step}: sharded state (FSDP2) of {world} ranks, gathered from every rank's lineage: read "
          f"{sum(len(r['read']) for r in ranks)} objects, {_human(nbytes)} (an unsharded restore or an export "
          f"replays each rank's chain and concatenates the shards)")
    for r in ranks:
        print(f"  rank {r['rank']} (generation {r['generation']}):")
        for o in r["read"]:
            print(f"    {o['object']}  {o['kind']} steps {o['steps'][0]}..{o['steps'][1]}  {_human(o['bytes'])}")
    return 0


def _lineages(storage) -> tuple[list[tuple], list[str]]:
    """``[(storage, key prefix, lineage)]``: the root's lineage and every shard lineage below it (all saved world
    sizes and ranks), each listed in full; and the keys of malformed manifests."""
    lineage, bad = load_lineage(storage, strict=False, use_index=False)
    parts = [(storage, "", lineage)]
    for world in shard_layout.saved_worlds(storage):
        for r in range(world):
            st, prefix = shard_layout.shard_storage(storage, world, r), shard_layout.shard_prefix(world, r)
            lin, b = load_lineage(st, strict=False, use_index=False)
            parts.append((st, prefix, lin))
            bad += [prefix + k for k in b]
    return parts, bad


def cmd_verify(storage, args) -> int:
    try:
        parts, bad = _lineages(storage)   # verify reads everything, every shard lineage's too
    except ManifestError as e:
        print(f"ray-ckpt: {e}", file=sys.stderr)
        return 1
    failures = [f"{k}: malformed manifest" for k in bad]
    todo = [(st, prefix, m) for st, prefix, lin in parts for m in lin.manifests]
    total = len(todo)
    t0 = time.perf_counter()
    nbytes = 0
    bar = _bar(args, total=total, desc="verify", unit="obj")
    for i, (st, prefix, m) in enumerate(todo, 1):
        try:
            data = read_object(st, m)
            if m.kind == "full":
                rec_fmt.decode_full(data, m.object)
            else:
                impl_by_name(m.strategy).decode_diffs(data, m.object)
            nbytes += m.nbytes
            status = "ok"
        except (CorruptObjectError, StorageError, ValueError) as e:
            failures.append(f"{prefix}{m.object}: {e}")
            status = "CORRUPT"
        if bar is not None:
            bar.update(1)
            if status != "ok":
                bar.write(f"{status:7s} {prefix}{m.object}", file=sys.stderr)
        elif not args.quiet:
            print(f"[{i}/{total}] {status:7s} {prefix}{m.object}", file=sys.stderr, flush=True)
    if bar is not None:
        bar.close()
    dt = time.perf_counter() - t0
    print(f"verified {total - len(failures)}/{total} objects ({_human(nbytes)}) in {dt:.2f} s")
    for f in failures:
        print(f"  {f}")
    return 1 if failures else 0


def _bar(args, **kw):
    """A tqdm bar on stderr when it is a terminal and not ``--quiet``; None otherwise."""
    if getattr(args, "quiet", False) or not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except OSError:
        size = None
    # a terminal that reports no size (0x0: some pseudo-terminals, serial consoles) would get hidden bars
    sized = size is not None and size.columns and size.lines
    return tqdm(file=sys.stderr, **({"dynamic_ncols": True} if sized else {"ncols": 80, "nrows": 24}), **kw)


class _PhaseBars:
    """``progress(phase, done, total)`` of :mod:`ray_ckpt.engine.export` as one bar per phase."""

    def __init__(self, args):
        self.args = args
        self.bars: dict = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        bar = self.bars.get(phase)
        if bar is None:
            bar = self.bars[phase] = _bar(self.args, total=total or None, desc=phase,
                                          unit={"read": "obj", "gather": "rank"}.get(phase, "step"))
        if bar is not None:
            bar.update(done - bar.n)

    def close(self) -> None:
        for b in self.bars.values():
            if b is not None:
                b.close()


def cmd_export(storage, args) -> int:
    fmt = getattr(args, "format", None) or "torch"
    bars = _PhaseBars(args)
    t0 = time.perf_counter()
    try:
        info = _export.export(storage, args.out, step=args.step, fmt=fmt, fallback=args.fallback,
                              overwrite=args.force, progress=bars)
    except (_export.ExportError, NoCheckpointError, CorruptObjectError) as e:
        bars.close()
        print(f"ray-ckpt: {e}", file=sys.stderr)
        return 1
    bars.close()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"step {info['step']} (generation {info['generation']}) of {info['source']} -> {args.out} "
              f"[{fmt}: {', '.join(info['files'])}] in {time.perf_counter() - t0:.2f} s")
    return 0


def _gc_objects(res, prefix: str = "") -> list[str]:
    return [prefix + o for o in (res.orphans + [m.object for m in res.deleted]
                                 + [f"ranks/{r}/{m.object}" for r, ms in res.rank_deleted.items() for m in ms]
                                 + [TIER_DIR + m.object for m in res.tier_deleted])]


def cmd_gc(storage, args) -> int:
    bar = None

    def progress(done, total):
        nonlocal bar
        if bar is None:
            bar = _bar(args, total=total, desc="gc", unit="obj")
        if bar is not None:
            bar.update(done - bar.n)

    try:
        res = _gc.collect(storage, args.keep_fulls, dry_run=args.dry_run, progress=progress)
        # sharded state: every rank's lineage, no rank collecting a step its world still needs
        shards = shard_chains.collect_sharded(storage, args.keep_fulls, dry_run=args.dry_run)
    except ValueError as e:
        print(f"ray-ckpt: {e}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    objects = _gc_objects(res)
    count, nbytes, kept_from = res.count, res.nbytes, res.kept_from_step
    for world, rank, _, sres in shards:
        objects += _gc_objects(sres, shard_layout.shard_prefix(world, rank))
        count, nbytes = count + sres.count, nbytes + sres.nbytes
        if kept_from is None or (sres.kept_from_step is not None and sres.kept_from_step < kept_from):
            kept_from = sres.kept_from_step   # a sharded root: the oldest step a rank keeps
    if args.json:
        print(json.dumps({"dry_run": res.dry_run, "kept_from_step": kept_from, "objects": objects,
                          "bytes": nbytes}, indent=2))
        return 0
    if count == 0:
        print(f"nothing to collect: at most {args.keep_fulls} full checkpoints on the current timeline of "
              f"{storage.describe()}" + (" and of every shard lineage" if shards else "") + ", no abandoned branch")
        return 0
    verb = "would delete" if res.dry_run else "deleted"
    kept = (f"kept the {args.keep_fulls} newest fulls (steps >= {kept_from})" if kept_from
            is not None else f"at most {args.keep_fulls} fulls on the current timeline")
    if shards:
        kept += (f" of every rank's lineage ({len(shards)} shard lineages; a step complete on every rank from "
                 f"there on stays so)")
    print(f"{kept}; {verb} {count} objects ({_human(nbytes)}), abandoned branches included")
    if res.dry_run:
        for o in objects:
            print(f"  {o}")
    return 0


def cmd_lease(storage, args) -> int:
    from ray_ckpt.engine.lease import describe, read_lease
    from ray_ckpt.lineage.layout import LEASE_KEY
    rec = read_lease(storage)
    # a sharded root: every rank lineage of every saved world size has a lease of its own
    shards = [(w, r, shard_layout.shard_storage(storage, w, r))
              for w in shard_layout.saved_worlds(storage) for r in range(w)]
    held = [(st, read_lease(st)) for _, _, st in shards]
    if args.json:
        print(json.dumps({"lease": rec, "shards": [{"world": w, "rank": r, "lease": lease}
                                                   for (w, r, _), (_, lease) in zip(shards, held)]}, indent=2))
    else:
        if rec is not None or not shards:
            print(f"no writer holds {storage.describe()}" if rec is None
                  else f"{storage.describe()} is held by {describe(rec)}")
        for (w, r, st), (_, lease) in zip(shards, held):
            print(f"  world {w} rank {r}: " + ("no writer" if lease is None else f"held by {describe(lease)}"))
    if args.release:
        released = [st for st, lease in [(storage, rec)] + held if lease is not None]
        for st in released:
            st.delete(LEASE_KEY)
        if released:
            print(f"released {len(released)} lease(s): the next writer may attach (if that job still runs, it "
                  f"stops at its next commit)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ray-ckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, fn, help_ in (("ls", cmd_ls, "list generations, objects and recoverable steps"),
                            ("inspect", cmd_inspect, "show the recovery plan for a step"),
                            ("verify", cmd_verify, "check every committed object")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("uri", help="storage root: a path, file://..., or s3://bucket/prefix")
        p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "inspect":
            p.add_argument("--step", type=int, default=None)
            p.add_argument("--plot", metavar="FILE", default=None,
                           help="also draw the lineage (steps, fulls, diffs, gaps, restores) to FILE (.png/.svg)")
        if name == "verify":
            p.add_argument("-q", "--quiet", action="store_true", help="no per-object progress")
        p.set_defaults(fn=fn)
    for name, help_ in (("export", "materialize a step into a directory (safetensors, PyTorch DCP or torch.save)"),
                        ("restore", "materialize a step into OUT/checkpoint.pt (export --format torch)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("uri", help="storage root: a path, file://..., or s3://bucket/prefix")
        p.add_argument("out", help="output directory (must not exist or be empty, unless --force)")
        p.add_argument("--step", type=int, default=None, help="the step (default: the latest recoverable)")
        if name == "export":
            p.add_argument("--format", choices=_export.FORMATS, default="safetensors")
        p.add_argument("--force", action="store_true", help="replace an existing OUT")
        p.add_argument("--fallback", action="store_true",
                       help="skip missing or corrupt objects: the latest good step at or before --step")
        p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(fn=cmd_export)
    p = sub.add_parser("lease", help="show (or --release) the writer lease: which job writes the lineage")
    p.add_argument("uri", help="storage root: a path, file://..., or s3://bucket/prefix")
    p.add_argument("--release", action="store_true",
                   help="delete the lease of a job that is gone, so that another writer may attach")
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_lease)
    p = sub.add_parser("gc", help="delete chains older than the K newest full checkpoints")
    p.add_argument("uri", help="storage root: a path, file://..., or s3://bucket/prefix")
    p.add_argument("--keep-fulls", type=int, required=True, metavar="K")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted; delete nothing")
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_gc)
    args = parser.parse_args(argv)
    try:
        storage = open_storage(args.uri, **_options(args.storage_option))
        return args.fn(storage, args)
    except (StorageError, ManifestError) as e:
        print(f"ray-ckpt: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
