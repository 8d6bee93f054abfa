"""Run code right after a module is imported, whoever imports it and whenever.

The start-up hook uses this to reach mergekit without importing it: nothing here imports more
than the standard library. A callback for a module that is already imported runs at once; one
for a module not yet imported runs when its import finishes, before the importer sees it (so a
``from module import name`` that follows gets what the callback left there).
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType

Callback = Callable[[ModuleType], None]

_PENDING: dict[str, list[Callback]] = {}


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once the module ``name`` is fully imported (now, if it is).

    A module that is being imported at this moment gets the callback at the end of its import
    only if a callback for it was registered before its import began (the start-up hook
    registers them all before anything imports mergekit)."""
    module = sys.modules.get(name)
    if module is not None and not _initializing(module):
        callback(module)
        return
    _PENDING.setdefault(name, []).append(callback)
    if not any(isinstance(finder, _Watcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Watcher())


def _initializing(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds watched modules through the other finders and runs their callbacks after the
    loader has executed them."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            for callback in _PENDING.pop(fullname, []):
                callback(module)

        loader.exec_module = exec_module  # this spec's own loader object
        return spec
