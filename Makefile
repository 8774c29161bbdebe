# ray_ckpt developer entry points. Every target creates .venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch 2.13 installs from local disk here; pyproject.toml admits a range around it.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.ray_ckpt-installed

.PHONY: venv demo test test-fast reliability bench bench-quick bench-fast bench-paired bench-scaling bench-fsdp bench-amber \
	bench-coordinator bench-scale bench-startup bench-budget bench-goodput bench-train-cpu bench-handoff clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PIP) install -q --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/failure_injection_demo.py

# the whole suite (what CI runs), in two pytest invocations whose union is every test: first the fast tier
# (below: neither Ray nor several ranks, not a fault trial) in two pytest-xdist workers, then the rest (markers
# ray, procs and fault, the latter set by conftest for tests/reliability) in one process, one session Ray cluster,
# with its 25 slowest tests listed. Ray tests stay serial: beside another xdist worker's tests each took about
# twice as long on 2 cores. Both invocations run; make fails if either failed
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=10 -m "not ray and not procs and not fault" tests; fast=$$?; \
	$(PY) -m pytest -q --durations=25 -m "ray or procs or fault" tests; rest=$$?; \
	test $$fast -eq 0 -a $$rest -eq 0

# the fast tier (~2 min here, in two pytest-xdist workers): everything that needs neither Ray (marker ray) nor a
# process group of several ranks (marker procs), without the fault trials of tests/reliability (outages, full
# disks, leases)
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=10 -m "not ray and not procs" --ignore=tests/reliability tests

# the long fault trials (SIGKILLs at 20 seeded points, 20 s outages...) with the table of their outcomes, then
# the other long tests (Ray Train SIGKILL and driver restart, the second continuation kill, the full-size fuzz,
# the benchmark harness smokes)
reliability: $(STAMP)
	$(PY) -m pytest -q tests/reliability --run-long
	$(PY) -m pytest -q tests --ignore=tests/reliability --run-long -m long

bench: $(STAMP)
	$(PY) -m benchmarks.run --mode full

bench-quick: $(STAMP)
	$(PY) -m benchmarks.run --mode quick

bench-fast: $(STAMP)
	$(PY) -m benchmarks.run --mode fast

# LowDiff's overhead resolved to ~1% of a step: two replicas in the same processes, alternating blocks
bench-paired: $(STAMP)
	$(PY) -m benchmarks.paired

# how the costs grow: 10M/40M/100M parameters at 2 workers, 1/2/4 workers at 10M
bench-scaling: $(STAMP)
	$(PY) -m benchmarks.paired --scaling

# FSDP2, a checkpoint every step: ray_ckpt's shard lineages vs DCP async_save vs none, interleaved;
# then the same with runtime="ray" (shard runs on a private local Ray); then HSDP (a 2x2 mesh, 4 ranks)
bench-fsdp: $(STAMP)
	$(PY) -m benchmarks.fsdp
	$(PY) -m benchmarks.fsdp --runtime ray
	$(PY) -m benchmarks.fsdp --replicas 2

# the overhead budget on the Fashion-MNIST-shaped loop and the GPT example, 1 and 2 DDP workers, Ray sharing the
# cores or on its own core, both runtimes: mean step overhead (95 % CI), the granularity chosen, lost-work bound,
# bytes and training-process CPU per step (10 rows, ~15 min)
bench-budget: $(STAMP)
	$(PY) -m benchmarks.budget --jobs fmnist gpt:small:1 --workers 1 2 --placements shared pinned

# the training process's own CPU per recorded step under runtime="ray" (per thread, next to the copies it must
# make), Ray pinned to one core and the trainer to the other; BEFORE=/path/to/another/tree adds that tree as a
# second arm in paired blocks (a before/after of a change)
bench-train-cpu: $(STAMP)
	$(PY) -m benchmarks.train_cpu --arms $(if $(BEFORE),before=$(BEFORE) after=.,current=.)

# what recording a step costs the training process (the whole process and the training thread, by thread) next to
# a copy of its bytes (cache-hot and rotating) and the target 2 x copy + 0.2 ms; and what handing over a full costs
# it next to torch.save: MLPs with 2.7/13/44 MB of gradients and a top-k 1 % row, runtime="local" and "ray"
# (a private Ray per cell), two replicas in paired rounds (14.4 min here at load average 25-40; python -m
# benchmarks.handoff --quick: 2.7 MB only, ~1.5 min)
bench-handoff: $(STAMP)
	$(PY) -m benchmarks.handoff

# the coordinator's periodic work against the length of a run (lineages of 10,000-360,000 steps; ~1 min)
bench-coordinator: $(STAMP)
	$(PY) -m benchmarks.coordinator_scale

# the control plane against the job's width: the real coordinator actor and 8-512 simulated nodes x 8 ranks at
# 10 steps/s, the report path before and after per-node aggregation (15-30 min on 2 cores: a saturated
# coordinator's backlog is drained after each row; --quick: 4 and 16 nodes, ~3 min)
bench-scale: $(STAMP)
	$(PY) -m benchmarks.scale

# Amber vs LowDiff dense through runtime="ray" (paired blocks, ~22 min), then Amber's selection pass vs memcpy
bench-amber: $(STAMP)
	$(PY) -m benchmarks.paired --job gpt:10m:4 --blocks 16 --hook none --strategies lowdiff lowdiff-amber amber --runtime ray
	$(PY) -m benchmarks.amber_select

# where ray_ckpt.train.attach spends its seconds at start-up and after a restart (Ray Train, 2 CPU workers,
# Fashion-MNIST MLP; 3 fits, ~5 min here)
bench-startup: $(STAMP)
	$(PY) -m benchmarks.startup

# goodput under failures: ETTR of ray_ckpt vs Ray Train's own checkpointing (torch.save + report every N steps,
# N by Young/Daly, a just-in-time report on a preemption notice) vs the failure-free run, with the same seeded
# schedule of worker SIGKILLs, node losses and preemptions (drain + removal at the deadline); Ray Train, 2 CPU
# workers on a 4-node ray.cluster_utils.Cluster, GPT 3.3M, 200 steps; 3 seeds x 6 faults (46 min here at load
# average 24-57 from other sessions, sized for ~25 min on a quieter machine; python -m benchmarks.goodput --quick:
# 1 seed, 3 faults, 120 steps)
bench-goodput: $(STAMP)
	$(PY) -m benchmarks.goodput

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
