"""Run code right after a module is imported, whoever imports it and whenever.

The start-up hook uses this to reach mergekit without importing it: nothing here imports more
than ``sys``. A callback for a module that is already imported runs at once; one for a module
not yet imported runs when its import finishes, before the importer sees it (so a
``from module import name`` that follows gets what the callback left there).
"""

from __future__ import annotations

import sys

_PENDING: dict = {}  # module name -> callbacks waiting for it
_WATCHER = "_lmc_mergekit_post_import"  # marks the finder, whichever copy of this module made it


def when_imported(name: str, callback) -> None:
    """Call ``callback(module)`` once the module ``name`` is fully imported (now, if it is).

    A module that is being imported at this moment gets the callback at the end of its import
    only if a callback for it was registered before its import began (the start-up hook
    registers them all before anything imports mergekit)."""
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", 0):
        callback(module)
        return
    _PENDING.setdefault(name, []).append(callback)
    if not any(getattr(finder, _WATCHER, False) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Watcher())


class _Watcher:
    """A meta-path finder that finds watched modules through the other finders and gives their
    spec a loader that runs the callbacks once the real loader has executed the module."""

    _lmc_mergekit_post_import = True

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
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenCall(spec.loader, fullname)
        return spec


class _ThenCall:
    """The real loader of one module, then the module's callbacks (those registered while it
    ran included). Anything else is the real loader's (resource readers, source)."""

    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        while _PENDING.get(self._name):
            for callback in _PENDING.pop(self._name):
                callback(module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)
