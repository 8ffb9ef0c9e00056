"""Module paths from before the layout step (commit 7d89549), still importable under those names.

Scripts written against the old flat layout (the shared reproducers among them: ``cluster.engine_actor``,
``cluster.llm``, ``workers.tiny_models``) import each moved module under its old name and get the module
itself, not a copy (``cluster.llm``, split in two, reads the names of both halves). Resolved on first import
only; ``import cluster`` installs the finder, so an old ``workers.*`` path resolves once ``cluster`` has been
imported. The three modules that became packages of
the same name export their old public names from the package instead (``cluster.engine``, ``cluster.serve``,
``workers.attention``; names the step deleted, such as ``slot_mapping``, are gone).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

MOVED = {
    "cluster.app": "cluster.serve.builder",
    "cluster.deltas": "workers.wire",
    "cluster.demo": "cluster.tools.demo",
    "cluster.engine_actor": "cluster.ray.engine_actor",
    "cluster.executors": "cluster.ray.executors",
    "cluster.kv_events": "cluster.engine.kv_events",
    "cluster.llm": ("cluster.engine.llm", "cluster.engine.build"),
    "cluster.loadgen": "cluster.loadtest.client",
    "cluster.planner": "cluster.tools.planner",
    "cluster.replicas": "cluster.routing.replicas",
    "cluster.router": "cluster.routing.policies",
    "cluster.scheduler": "cluster.engine.scheduler",
    "cluster.tokenizer": "cluster.engine.tokenizer",
    "cluster.train_default_model": "cluster.tools.train_default_model",
    "workers.cost_model": "workers.sim.cost_model",
    "workers.cuda_graphs": "workers.runtime.cuda_graphs",
    "workers.layer_kinds": "workers.models.layer_kinds",
    "workers.mirrors": "workers.runtime.mirrors",
    "workers.model_runner": "workers.runtime.model_runner",
    "workers.presets": "workers.sim.presets",
    "workers.sampling": "workers.runtime.sampling",
    "workers.simulated": "workers.sim.simulated",
    "workers.step_inputs": "workers.runtime.step_inputs",
    "workers.tiny_models": "workers.models.tiny_models",
    "workers.triton_attention": "workers.attention.triton_paged",
    "workers.worker": "workers.runtime.worker",
}


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of ``MOVED`` and loads it as the module at its new path."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        if isinstance(new, str):
            return importlib.import_module(new)
        parts = [importlib.import_module(n) for n in new]
        module = types.ModuleType(spec.name, f"{spec.name}, now split into {', '.join(new)}")

        def __getattr__(name):
            for part in parts:
                if hasattr(part, name):
                    return getattr(part, name)
            raise AttributeError(f"module {spec.name!r} has no attribute {name!r}")
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module) -> None:
        pass    # the new module ran when it was imported


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
