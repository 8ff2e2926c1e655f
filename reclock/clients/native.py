"""Loading reclock's optional C extensions, also where a zip shadows them.

On a Spark cluster the driver ships reclock's packages to the executors as a
zip (``reclock.runtime.spark.package_zip``) placed first on their ``sys.path``, so
that driver and executors run the same Python code. Python cannot import an
extension module from a zip, so there ``import reclock.sources._kafka_native`` fails
although the executor's installed copy (the image's site-packages, or an
editable install) holds a built one. :func:`load_extension` then asks the
other import finders where the package is installed and loads the extension
from there. It returns None when no built extension exists anywhere: the
callers then use their Python paths.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType


def load_extension(package: str, name: str) -> ModuleType | None:
    """``package.name`` (a C extension), or None if it was not built."""
    fullname = f"{package}.{name}"
    try:
        return importlib.import_module(fullname)
    except ImportError:
        pass
    for where in _installed(package):
        ext = importlib.machinery.PathFinder.find_spec(fullname, [where])
        if ext is None or not isinstance(ext.loader, importlib.machinery.ExtensionFileLoader):
            continue
        module = importlib.util.module_from_spec(ext)
        ext.loader.exec_module(module)
        sys.modules[fullname] = module
        return module
    return None


def _installed(package: str) -> list[str]:
    """Directories outside zips holding ``package`` (dotted: a subpackage):
    where the import finders (an editable install's too) and ``sys.path``
    place its top-level package."""
    top, *rest = package.split(".")
    dirs: list[str] = []
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        try:
            spec = find(top, None) if find is not None else None
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            dirs += [os.path.join(d, *rest) for d in spec.submodule_search_locations or []]
    dirs += [os.path.join(entry, top, *rest) for entry in sys.path if entry]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]
