"""Module paths from before the layout step still import (``cluster/moved.py``): scripts written against
the flat layout, the shared reproducers among them, get the very module at its new path (``cluster.llm``,
split in two, the names of both halves)."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from cluster.moved import MOVED


@pytest.mark.parametrize("old", sorted(o for o, n in MOVED.items() if isinstance(n, str)))
def test_an_old_module_path_is_the_module_at_its_new_path(old):
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_the_old_llm_module_split_in_two_reads_the_names_of_both():
    import cluster.llm as old
    from cluster.engine import build, llm
    assert MOVED["cluster.llm"] == ("cluster.engine.llm", "cluster.engine.build")
    assert (old.LLM, old.CompletionOutput) == (llm.LLM, llm.CompletionOutput)
    assert (old.model_config, old.eos_token_ids, old.resolve_model) == (build.model_config, build.eos_token_ids,
                                                                       build.resolve_model)
    with pytest.raises(AttributeError, match="'cluster.llm' has no attribute 'nope'"):
        old.nope


def test_the_old_engine_modules_names_resolve_in_the_engine_package():
    import cluster.engine
    from cluster.engine import engine
    assert (cluster.engine.Engine, cluster.engine.WorkerFailure) == (engine.Engine, engine.WorkerFailure)


def test_the_reproducers_old_imports_resolve_in_a_fresh_interpreter():
    # As repro_llm_eos.py and repro_abort_hang.py import them: cluster first, then the old paths.
    code = ("from cluster import LLM\n"
            "from workers.tiny_models import build_tiny_model\n"
            "from cluster.engine_actor import EngineService\n"
            "from cluster.llm import build_engine\n"
            "import workers.models.tiny_models as t, cluster.ray.engine_actor as e, cluster.engine.build as b\n"
            "print(build_tiny_model is t.build_tiny_model, EngineService is e.EngineService, build_engine is b.build_engine)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True"]


def test_the_old_serve_modules_names_resolve_in_the_serve_package():
    from cluster.serve import CompletionBody, OpenAIServer, prometheus_text
    from cluster.serve.metrics import prometheus_text as metrics_prometheus_text
    from cluster.serve.openai import CompletionBody as Body
    from cluster.serve.server import OpenAIServer as Plain
    assert CompletionBody is Body and prometheus_text is metrics_prometheus_text
    # serve.py's OpenAIServer was the Serve deployment: the class it wraps serves the same routes
    assert issubclass(OpenAIServer.func_or_class, Plain)
    import cluster.serve
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        cluster.serve.Nope


def test_a_path_that_never_existed_still_fails_to_import():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("cluster.no_such_module")
