"""Run a script as if some packages were not installed: `python without_packages.py ray,vllm SCRIPT [ARGS...]`.

Python's path finder does not find the named top-level packages (nor their submodules), so `import ray` raises
ModuleNotFoundError and `importlib.util.find_spec("ray")` is None, as on a machine without them; everything else
imports from this environment as usual."""

from __future__ import annotations

import importlib.machinery
import runpy
import sys


def hide(packages: set[str]) -> None:
    find_spec = importlib.machinery.PathFinder.find_spec.__func__

    def without_hidden(cls, name, path=None, target=None):
        if name.partition(".")[0] in packages:
            return None
        return find_spec(cls, name, path, target)

    importlib.machinery.PathFinder.find_spec = classmethod(without_hidden)
    for name in [module for module in sys.modules if module.partition(".")[0] in packages]:
        del sys.modules[name]


if __name__ == "__main__":
    hide(set(sys.argv[1].split(",")))
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
