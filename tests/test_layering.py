"""Layers only import downwards (docs/architecture.md): checked on the source's import statements."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ray_ckpt")

# layer -> ray_ckpt subpackages it may import (itself included); "ray" marks layers allowed to import Ray
ALLOWED = {
    "format": {"format"},
    "storage": {"storage"},
    "lineage": {"lineage"},
    "policy": {"policy", "lineage"},   # the policy report's key (lineage/layout.py)
    "engine": {"engine", "format", "storage", "lineage", "policy", "config"},
    "runtime": {"runtime", "engine", "format", "storage", "lineage", "policy", "config", "ray"},
    "integrations": {"integrations", "api", "runtime", "engine", "format", "storage", "lineage", "policy", "config",
                     "ray"},
    "api": {"api", "runtime", "engine", "format", "storage", "lineage", "policy", "config"},
    "cli": {"cli", "engine", "format", "storage", "lineage", "policy", "config"},
    # the top-level modules: config is pure; train / compression are the public faces of integrations
    "config": {"config"},
    "train": {"train", "integrations"},
    "compression": {"compression", "integrations"},
}


def _imports(path):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            if node.module == "ray_ckpt":
                for a in node.names:
                    yield f"ray_ckpt.{a.name}"


def test_every_module_belongs_to_a_checked_layer():
    """A module outside ALLOWED would escape the check above (config.py, train.py and compression.py once did)."""
    tops = {f[:-3] if f.endswith(".py") else f for f in os.listdir(PKG)
            if (f.endswith(".py") and f != "__init__.py") or os.path.isdir(os.path.join(PKG, f, ""))
            and os.path.exists(os.path.join(PKG, f, "__init__.py"))}
    assert tops == set(ALLOWED), f"unchecked: {sorted(tops - set(ALLOWED))}, gone: {sorted(set(ALLOWED) - tops)}"


def test_layers_import_only_downwards():
    problems = []
    for layer, allowed in ALLOWED.items():
        base = os.path.join(PKG, layer)
        paths = [base + ".py"] if os.path.isfile(base + ".py") else [
            os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs if f.endswith(".py")]
        assert paths, f"layer {layer!r} has no source files"
        for path in paths:
            for mod in _imports(path):
                top = mod.split(".")
                if top[0] == "ray" and "ray" not in allowed:
                    problems.append(f"{path}: imports {mod} (Ray) from pure layer {layer!r}")
                if top[0] == "ray_ckpt" and len(top) > 1 and top[1] not in allowed:
                    problems.append(f"{path}: layer {layer!r} imports {mod}")
    assert not problems, "\n".join(problems)


def _python_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter (nothing imported yet) and require it to succeed."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_pure_layers_import_without_ray():
    _python_ok("import sys; import ray_ckpt.format, ray_ckpt.storage, ray_ckpt.lineage, ray_ckpt.policy, "
               "ray_ckpt.config, ray_ckpt.api; assert 'ray' not in sys.modules, 'ray was imported'")


def test_the_persistence_actors_and_the_package_import_without_torch():
    """The coordinator and the persistence workers hold bytes and manifests: their processes (one per run and per
    node, restarted with the run) import neither torch nor the tensor codecs: over a second less CPU per actor start
    and ~185 MB less memory each (docs/architecture.md). ``import ray_ckpt`` stays light too; its public names
    load on first use."""
    _python_ok("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'torch':\n"
               "            raise ImportError('torch imported by ' + repr(sys._getframe(1).f_code.co_filename))\n"
               "sys.meta_path.insert(0, Block())\n"
               "import ray_ckpt, ray_ckpt.runtime.coordinator, ray_ckpt.runtime.worker\n"
               "assert ray_ckpt.__version__ and 'Checkpointer' in dir(ray_ckpt)\n")
    # and the lazy names resolve to the same objects as their modules'
    _python_ok("import ray_ckpt, ray_ckpt.api, ray_ckpt.lineage, ray_ckpt.format.container as c\n"
               "assert ray_ckpt.Checkpointer is ray_ckpt.api.Checkpointer\n"
               "assert ray_ckpt.NoCheckpointError is ray_ckpt.lineage.NoCheckpointError\n"
               "assert ray_ckpt.CorruptObjectError is c.CorruptObjectError\n"
               "assert ray_ckpt.train.RayCkptCallback\n"
               "try:\n    ray_ckpt.nothing_here\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n")
