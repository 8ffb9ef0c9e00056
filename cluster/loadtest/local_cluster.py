"""A multi-node Ray cluster on this host (Ray's ``cluster_utils.Cluster``), on loopback, that leaves no
process behind: every process it starts carries a mark in its environment, so one that no node list names
(a node that Ctrl-C interrupted while it started: its agents outlived it) is still found, and killed when the
cluster goes down on an exception."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from cluster.ray.engine_actor import NAMESPACE
from cluster.ray.launch import RAY_ENV
from workers.shm_channel import process_alive

ROOT = Path(__file__).resolve().parents[2]
HEAD_RESOURCE = "swakv_head"       # pins the engine actor and the Serve replica to the head node
MARK = "SWAKV_LOCAL_CLUSTER"       # set to the cluster's id in the environment of every process it starts


class LocalCluster:
    """A head (0 CPUs) and ``nodes - 1`` worker nodes on this host, on loopback; a context manager."""

    def __init__(self, nodes: int = 3, cpus_per_node: int = 2):
        self.nodes, self.cpus_per_node = nodes, cpus_per_node
        self.cluster = None
        self.worker_nodes: list = []
        self.pids: list[int] = []
        self.mark = uuid.uuid4().hex

    def __enter__(self) -> LocalCluster:
        os.environ[MARK] = self.mark
        for key, value in RAY_ENV.items():
            os.environ.setdefault(key, value)
        # Ray's worker processes import the engine builder and the cluster package from here.
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if str(ROOT) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), *paths]))
        import ray
        from ray.cluster_utils import Cluster
        if ray.is_initialized():
            raise RuntimeError("Ray is already initialised in this process; the load test brings up its own cluster")
        try:
            with _callers_stop_handlers():
                with _private_address():
                    self.cluster = Cluster(initialize_head=True, head_node_args={
                        "num_cpus": 0, "resources": {HEAD_RESOURCE: 1}, "include_dashboard": False})
                self.worker_nodes = [self.cluster.add_node(num_cpus=self.cpus_per_node)
                                     for _ in range(self.nodes - 1)]
                ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
            self.cluster.wait_for_nodes(timeout=60)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _all_pids(self) -> list[int]:
        """The nodes' processes (GCS, raylets, agents), every descendant (worker processes), and every other
        process with this cluster's mark."""
        nodes = [self.cluster.head_node, *self.cluster.worker_nodes] if self.cluster is not None else []
        roots = {i.process.pid for node in nodes if node is not None
                 for infos in node.all_processes.values() for i in infos if i.process is not None}
        return sorted(roots | _descendants(roots) | self._marked_tree())

    def __exit__(self, *exc) -> None:
        import ray
        try:
            from ray import serve
            if ray.is_initialized():
                serve.shutdown()
        except Exception:  # noqa: BLE001 - tearing down anyway
            pass
        if ray.is_initialized():
            ray.shutdown()
        self.pids = self._all_pids()
        if self.cluster is not None:
            with _private_address():
                self.cluster.shutdown()
        if exc and exc[0] is not None:     # interrupted or failed: nothing may outlive the driver
            self._sweep()
        os.environ.pop(MARK, None)

    def _sweep(self, wait_s: float = 5.0, rounds: int = 20) -> None:
        """Kill what is left of the cluster ``wait_s`` after its shutdown: a node interrupted while it started
        is in no list, its raylet lives until the driver exits, and its agents outlive that. Again until
        none is left (a raylet restarts an agent killed before it), at most ``rounds`` times."""
        deadline = time.monotonic() + wait_s
        while (left := self._marked_tree()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for _ in range(rounds):
            if not left:
                return
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
            left = self._marked_tree()

    def _marked_tree(self) -> set[int]:
        """Live processes with this cluster's mark and all below them (Ray retitles its agents, which
        overwrites their environment and the mark: they are found below their raylet, which keeps it)."""
        marked = _marked(f"{MARK}={self.mark}".encode())
        return marked | _descendants(marked)

    def processes_left(self, wait_s: float = 10.0) -> int:
        """How many of the cluster's processes are still alive (waiting up to ``wait_s`` for them to exit)."""
        deadline = time.monotonic() + wait_s
        while True:
            alive = {pid for pid in self.pids if process_alive(pid)} | self._marked_tree()
            if not alive or time.monotonic() > deadline:
                return len(alive)
            time.sleep(0.2)

    def restore(self) -> None:
        """Add worker nodes until there are ``nodes - 1`` again (after a node was killed), as an autoscaler would."""
        while len(self.cluster.worker_nodes) < self.nodes - 1:
            with _callers_stop_handlers():
                self.worker_nodes.append(self.cluster.add_node(num_cpus=self.cpus_per_node))
        self.cluster.wait_for_nodes(timeout=60)

    def node_index(self, node_id: str) -> int:
        """0 for the head, i for the i-th worker node added (removed nodes keep their number)."""
        if self.cluster.head_node.node_id == node_id:
            return 0
        return 1 + [n.node_id for n in self.worker_nodes].index(node_id)


@contextlib.contextmanager
def _callers_stop_handlers():
    """Keep the caller's SIGTERM and SIGINT handlers while the cluster starts: each node ``Cluster`` starts in
    this process installs a SIGTERM handler of its own (it drains for up to 30 s), and so does ``ray.init``'s
    core worker (it aborts with a stack dump). Ray's helper that installs them does nothing meanwhile, so a
    SIGTERM during the start reaches the caller's handler too; the handlers are put back as they were."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import ray._private.utils as ray_utils
    install = getattr(ray_utils, "set_sigterm_handler", None)
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    if install is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if install is not None:
            ray_utils.set_sigterm_handler = install
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


@contextlib.contextmanager
def _private_address():
    """Keep /tmp/ray/ray_current_cluster as it was: ``Cluster`` writes its address there (and deletes the
    file at shutdown), and any plain ``ray.init()`` on this host would then join the load test's cluster."""
    from ray._common.utils import get_ray_address_file
    path = get_ray_address_file(None)
    try:
        with open(path, encoding="utf-8") as f:
            before = f.read()
    except OSError:
        before = None
    try:
        yield
    finally:
        if before is None:
            with contextlib.suppress(OSError):
                os.remove(path)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(before)


def _descendants(roots: set[int]) -> set[int]:
    """Every live descendant of ``roots``, from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _marked(mark: bytes) -> set[int]:
    """Live processes (not this one) whose environment holds ``mark`` (``NAME=value``), from /proc."""
    found = set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.add(int(entry))
            except OSError:
                continue
    return found
