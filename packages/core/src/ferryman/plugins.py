"""The plugin host: the one class that touches ``pm.hook``.

It loads core's default plugins and (unless told not to) every entry point in the ``ferryman``
group, checks that every hook implementation matches a spec, collects the registration records
per role, refuses duplicate names (naming both distributions) and calls observer hooks without
letting one observer's exception stop a run.

``FERRYMAN_DISABLE_PLUGINS`` is a comma-separated list of entry-point names (``engine_hf``) or
distribution names (``ferryman-engine-hf``) to skip; ``*`` skips every external plugin.
``FERRYMAN_PLUGINS`` is a comma-separated list of importable modules registered as plugins in
every process that builds a host (like ``PYTEST_PLUGINS``): a plugin that is not installed, such
as a benchmark's env, reaches the Ray actors that way.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from ferryman import hookspecs
from ferryman.specs import ROLES, _Spec

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "ferryman"
DISABLE_ENV = "FERRYMAN_DISABLE_PLUGINS"
PLUGINS_ENV = "FERRYMAN_PLUGINS"

DEFAULT_PLUGINS = (
    "ferryman.defaults.queue",
    "ferryman.defaults.router",
    "ferryman.defaults.weight_sync",
    "ferryman.defaults.trackers",
    "ferryman.envs.digits",
    "ferryman.envs.sequence",
)
"""Core's own implementations, registered through the same hooks as any plugin."""


class PluginError(RuntimeError):
    """A plugin could not be loaded or registered something invalid."""


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin module."""

    name: str
    """Entry-point name, or the module name for core defaults."""
    distribution: str
    version: str
    module: str


class PluginHost:
    """Typed façade over a pluggy PluginManager."""

    def __init__(self, *, load_entry_points: bool = True, extra_plugins: tuple[Any, ...] = ()) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._info: dict[str, PluginInfo] = {}
        self._disabled: list[md.EntryPoint] = []
        """Entry points skipped by ``FERRYMAN_DISABLE_PLUGINS`` (for error messages)."""
        core_version = _dist_version("ferryman")
        for modname in DEFAULT_PLUGINS:
            self._register(importlib.import_module(modname), PluginInfo(modname, "ferryman", core_version, modname))
        if load_entry_points:
            self._load_entry_points()
        for modname in (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",")):
            if modname:
                try:
                    module = importlib.import_module(modname)
                except Exception as e:  # noqa: BLE001 - report which module broke
                    raise PluginError(f"{PLUGINS_ENV}: module {modname!r} failed to import: {e!r}") from e
                self._register(module, PluginInfo(modname, f"<{PLUGINS_ENV}>", "", modname))
        for plugin in extra_plugins:
            name = getattr(plugin, "__name__", repr(plugin))
            self._register(plugin, PluginInfo(name, "<in-process>", "", name))
        self.pm.check_pending()
        self._specs: dict[str, dict[str, _Spec]] | None = None
        self._owner: dict[tuple[str, str], PluginInfo] = {}

    # ------------------------------------------------------------------ loading
    def _register(self, plugin: Any, info: PluginInfo) -> None:
        if self.pm.is_registered(plugin):
            return
        self.pm.register(plugin, name=info.module)
        self._info[info.module] = info

    def _load_entry_points(self) -> None:
        disabled = {s.strip() for s in os.environ.get(DISABLE_ENV, "").split(",") if s.strip()}
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "<unknown>"
            version = ep.dist.version if ep.dist is not None else ""
            if "*" in disabled or ep.name in disabled or dist in disabled or _norm(dist) in {_norm(d) for d in disabled}:
                log.info("plugin %s (%s) disabled by %s", ep.name, dist, DISABLE_ENV)
                self._disabled.append(ep)
                continue
            try:
                module = ep.load()
            except Exception as e:  # noqa: BLE001 - report which plugin broke
                raise PluginError(f"plugin {ep.name!r} from {dist} {version} failed to load: {e!r}") from e
            if not isinstance(module, ModuleType):
                raise PluginError(f"plugin {ep.name!r} from {dist}: entry point must name a module, got {module!r}")
            self._register(module, PluginInfo(ep.name, dist, version, module.__name__))

    # ------------------------------------------------------------------ registration records
    def _collect(self) -> dict[str, dict[str, _Spec]]:
        if self._specs is not None:
            return self._specs
        specs: dict[str, dict[str, _Spec]] = {role: {} for role in ROLES}
        for role, hook_name in hookspecs.REGISTRATION_HOOKS.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                info = self._info.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "<unknown>", "", impl.plugin_name)
                try:
                    records = impl.function()
                except Exception as e:  # noqa: BLE001
                    raise PluginError(f"{hook_name} of {info.distribution} ({info.module}) raised {e!r}") from e
                for rec in records or []:
                    if not isinstance(rec, ROLES[role]):
                        raise PluginError(
                            f"{hook_name} of {info.distribution} ({info.module}) returned "
                            f"{type(rec).__name__}, expected {ROLES[role].__name__}"
                        )
                    if rec.name in specs[role]:
                        other = self._owner[(role, rec.name)]
                        raise PluginError(
                            f"duplicate {role} name {rec.name!r}: registered by {other.distribution} "
                            f"({other.module}) and by {info.distribution} ({info.module})"
                        )
                    specs[role][rec.name] = rec
                    self._owner[(role, rec.name)] = info
        self._specs = specs
        return specs

    def specs(self, role: str) -> dict[str, _Spec]:
        """Registered records of one role by name."""
        if role not in ROLES:
            raise KeyError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        return dict(self._collect()[role])

    def get(self, role: str, name: str) -> _Spec:
        specs = self.specs(role)
        if name not in specs:
            raise PluginError(f"no {role} named {name!r} (installed: {', '.join(sorted(specs)) or 'none'})")
        return specs[name]

    def disabled_provider(self, role: str, name: str) -> str | None:
        """Which plugin disabled by ``FERRYMAN_DISABLE_PLUGINS`` would register ``name`` for
        ``role`` (asked of its hooks module, which imports nothing heavy), or None."""
        hook = hookspecs.REGISTRATION_HOOKS.get(role)
        for ep in self._disabled:
            try:
                register = getattr(ep.load(), hook or "", None)
                records = register() if callable(register) else []
            except Exception:  # noqa: BLE001 - a broken disabled plugin names nothing
                continue
            if any(getattr(rec, "name", None) == name for rec in records or []):
                dist = ep.dist.name if ep.dist is not None else "<unknown>"
                return f"plugin {ep.name!r} of {dist}, disabled by {DISABLE_ENV}={os.environ.get(DISABLE_ENV, '')}"
        return None

    def owner(self, role: str, name: str) -> PluginInfo:
        self._collect()
        return self._owner[(role, name)]

    def create(self, role: str, config: Any, **context: Any) -> Any:
        """Build the implementation named by ``config.type`` with its factory."""
        return self.get(role, config.type).factory(config, **context)

    def plugins(self) -> list[PluginInfo]:
        return list(self._info.values())

    # ------------------------------------------------------------------ observers
    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call an observer hook; an exception in one observer is logged, never raised."""
        if hook_name not in hookspecs.OBSERVER_HOOKS:
            raise KeyError(f"{hook_name} is not an observer hook")
        caller = getattr(self.pm.hook, hook_name)
        for impl in caller.get_hookimpls():
            try:
                impl.function(**{k: kwargs[k] for k in impl.argnames})
            except Exception:  # noqa: BLE001
                log.exception("observer %s in %s failed", hook_name, impl.plugin_name)

    # ------------------------------------------------------------------ listing
    def describe(self) -> str:
        """The ``ferryman plugins`` listing."""
        lines = ["plugins:"]
        for info in sorted(self._info.values(), key=lambda i: (i.distribution != "ferryman", i.distribution, i.name)):
            lines.append(f"  {info.distribution} {info.version}  [{info.name}]  {info.module}")
        for role in ROLES:
            lines.append(f"{role}:")
            for name, spec in sorted(self.specs(role).items()):
                owner = self.owner(role, name)
                desc = f"  - {spec.description}" if spec.description else ""
                lines.append(f"  {name:<16} {owner.distribution} {owner.version}{desc}")
        return "\n".join(lines)


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def _dist_version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "unknown"
