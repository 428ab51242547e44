"""Modules that register drafters when imported: `--plugin MODULE` on the command line and
ADASPEC_PLUGINS everywhere (a module name, or the path of a .py file)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path

from ..errors import PluginError

_loaded: set[str] = set()


def load(names: Iterable[str]) -> None:
    """Import each plugin once per process; a failure names the plugin and the cause."""
    for name in names:
        name = name.strip()
        if name and name not in _loaded:
            _loaded.add(name)  # first: a plugin that looks drafters up is not imported twice
            try:
                _import(name)
            except PluginError:
                _loaded.discard(name)
                raise


def _import(name: str) -> None:
    try:
        if name.endswith(".py"):
            path = Path(name).expanduser().resolve()
            if not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            spec = importlib.util.spec_from_file_location(f"adaspec_plugin_{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(name)
    except Exception as exc:
        raise PluginError(
            f"plugin {name!r} could not be imported ({type(exc).__name__}: {exc}); accepted: "
            "an importable module name or the path of a .py file, which registers drafters "
            "with adaspec.register_drafter when imported"
        ) from exc


HOW_TO_REGISTER = (
    "to add a drafter, call adaspec.register_drafter(NAME, factory) in a module and name that "
    "module with --plugin MODULE (or a .py path) or ADASPEC_PLUGINS=MODULE, or declare it under "
    "the 'adaspec.drafters' entry-point group of an installed package (docs/testing.md)"
)
