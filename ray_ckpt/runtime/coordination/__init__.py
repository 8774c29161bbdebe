"""The parts of a run's coordinator (:mod:`ray_ckpt.runtime.coordinator`), one concern each.

The :class:`~ray_ckpt.runtime.coordinator.Coordinator` actor is a shell: each of its remote methods hands the
call to one of these objects, which it builds in its constructor and wires together. Only :mod:`.cluster` talks
to Ray (the run's other actors, the node list); every other part is plain Python over the lineage's manifests and
storage, given the cluster's calls as plain callables, so tests build and drive it without Ray.

==================  ==========================================================================================
:mod:`.state`       :class:`LineageState`: every known object (manifest, durable, live holders), the lineage views
:mod:`.healing`     :class:`Healing`: gaps in the step sequence, full checkpoints asked of the trainer, lost nodes
:mod:`.replicas`    :class:`ReplicaHealth`: the state-tier replica's progress and whether it is usable
:mod:`.planner`     :class:`RestorePlanner`: the restore plan (which chain, memory or storage, which references)
:mod:`.collector`   :class:`GarbageCollector`: retention (``keep_fulls``), per-rank and Amber collection
:mod:`.clock`       :class:`RunClock`: failures, events, time running, the budget's granularity and MTBF
:mod:`.tuning`      :class:`AdaptiveTuning`: the adaptive frequency policy fed by commits, trainers, failures
:mod:`.drains`      :class:`Drains`: node drains (preemption notices), their records on storage
:mod:`.reporting`   :class:`ReportPacing`, :class:`MetricsGate`, :class:`LeaseKeeper`: report interval, metrics,
                    the writer lease's heartbeat
:mod:`.cluster`     :class:`RayCluster`: the Ray calls (alive nodes, the run's workers and replica)
==================  ==========================================================================================

Everything runs in the coordinator actor, one call at a time (Ray runs an actor's calls in one thread); nothing
here is thread-safe, and nothing needs to be.
"""
