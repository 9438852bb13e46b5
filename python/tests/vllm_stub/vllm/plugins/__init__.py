"""load_general_plugins as vLLM has it. Entry points come from ENTRY_POINTS (group -> list of EntryPoint), which
tests fill (register_entry_point) instead of importlib.metadata."""
import importlib
import logging
import os

logger = logging.getLogger(__name__)

DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"
plugins_loaded = False
ENTRY_POINTS = {}


class EntryPoint:
    """name, value ("module:attr") and load(), as importlib.metadata's; `target` may be the callable itself or a
    zero-argument function that raises (a plugin failing at import)."""

    def __init__(self, name, value, group=DEFAULT_PLUGINS_GROUP, target=None):
        self.name, self.value, self.group, self._target = name, value, group, target

    def load(self):
        if self._target is not None:
            return self._target
        mod, _, attr = self.value.partition(":")
        obj = importlib.import_module(mod)
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
        return obj


def register_entry_point(name, value_or_callable, group=DEFAULT_PLUGINS_GROUP):
    if callable(value_or_callable):
        ep = EntryPoint(name, f"<callable {getattr(value_or_callable, '__qualname__', value_or_callable)}>", group,
                        value_or_callable)
    else:
        ep = EntryPoint(name, value_or_callable, group)
    ENTRY_POINTS.setdefault(group, []).append(ep)
    return ep


def _allowed_plugins():
    v = os.environ.get("VLLM_PLUGINS")
    return None if v is None else [x for x in v.split(",") if x]


def load_plugins_by_group(group):
    allowed = _allowed_plugins()
    discovered = list(ENTRY_POINTS.get(group, []))
    if not discovered:
        logger.debug("No plugins for group %s found.", group)
        return {}
    log = logger.debug if group == DEFAULT_PLUGINS_GROUP else logger.info
    log("Available plugins for group %s:", group)
    for p in discovered:
        log("- %s -> %s", p.name, p.value)
    plugins = {}
    for p in discovered:
        if allowed is None or p.name in allowed:
            try:
                plugins[p.name] = p.load()
            except Exception:
                logger.exception("Failed to load plugin %s", p.name)
    return plugins


def load_general_plugins():
    """Runs once a process; exceptions around loading an entry point are logged, not around calling it."""
    global plugins_loaded
    if plugins_loaded:
        return
    plugins_loaded = True
    for func in load_plugins_by_group(DEFAULT_PLUGINS_GROUP).values():
        func()


def _reset():
    global plugins_loaded
    plugins_loaded = False
    ENTRY_POINTS.clear()
