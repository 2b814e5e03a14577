"""The repository's top-level folders under their own names.

``kernels/``, ``eval/`` and ``bench/`` are installed as ``abft.kernels``, ``abft.eval`` and
``abft.bench``. From the repository's root (``python -m pytest``, ``python -c``, a notebook
started there) the root is on ``sys.path``, so ``import kernels`` would find the folder before an
installed distribution of that name (transformers 5.25 imports the ``kernels`` distribution). Each
folder's ``__init__`` calls ``hand_over`` when it is imported under its top-level name: the import
gives what it gives without the repository on the path, or fails as it would there. Standard
library only: it runs before anything else of the package.
"""
import importlib.util
import os
import sys
from importlib.machinery import PathFinder


def _root(init_file):
    return os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(init_file))))


def hand_over(name, init_file):
    """Put the module ``import name`` finds on ``sys.path`` without the repository's root in
    ``sys.modules[name]`` (the import system returns it), or raise ``ModuleNotFoundError``."""
    root = _root(init_file)
    for key in [k for k in sys.modules if k.startswith(name + ".")]:      # this helper, under kernels
        if os.path.realpath(getattr(sys.modules[key], "__file__", None) or "").startswith(root + os.sep):
            del sys.modules[key]
    path = [p for p in sys.path if os.path.realpath(os.path.abspath(p or os.curdir)) != root]
    spec = PathFinder.find_spec(name, path)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r} (the repository's {name}/ folder is "
                                  f"imported as abft.{name})", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
