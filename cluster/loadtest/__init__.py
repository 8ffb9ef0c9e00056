"""``swakv loadtest``: a multi-node Ray cluster on this host, the Serve app, an open-loop load, a report.

The cluster is Ray's own ``cluster_utils.Cluster``: a head node with no CPUs (it runs the engine actor
and Serve, as the head of ``ray_configs/cluster-aws-gpu.yaml`` does) and ``nodes - 1`` worker nodes
whose CPUs stand for GPUs; the pipeline stages are spread over them. The same workload runs once per KV
layout: window-aware (the preset as it is) and sliding-as-full (every layer allocated as full
attention, as engines without hybrid support do; attention still reads only the window, so step times
are the same and only memory differs). Faults are optional: ``--kill-worker-at`` kills stage 0's worker
actor, ``--kill-node-at`` a worker node with a stage on it. Everything is torn down at the end, failed
runs included; the report says whether any process of the cluster is left.

With ``--data-parallel-size N`` (or ``--router`` / ``--compare-routers``) the runs compare routers instead
of layouts: N engine replicas, each with its own workers spread over the worker nodes, behind one Serve
app that routes with each router in turn, on the same arrivals (engines restarted between routers, so
each starts cold). ``--kill-replica-at`` kills replica 0's engine actor mid-run; Ray restarts it.

The parts: ``config`` (what a run needs, checked), ``workloads`` (sessions and traces), ``client`` (the
open-loop HTTP load generator and a run's figures), ``local_cluster`` (the Ray nodes on this host),
``actions`` (engines, the app, faults), ``run`` (one run per layout or router), ``report`` (tables and
plots), ``cli`` (the subcommand).
"""
