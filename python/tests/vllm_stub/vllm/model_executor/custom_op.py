"""CustomOp and PluggableLayer: vLLM's registries, the out-of-tree swap in __new__, and dispatch_forward."""
import torch.nn as nn

from vllm.config import get_cached_compilation_config
from vllm.logger import init_logger
from vllm.platforms import current_platform

logger = init_logger(__name__)

op_registry = {}
op_registry_oot = {}


def maybe_get_oot_by_class(class_type):
    return op_registry_oot.get(class_type.__name__, class_type)


def _oot_decorator(cls, _decorated, name, what):
    def decorator(op_cls):
        reg_name = name if name is not None else cls.__name__
        assert reg_name not in op_registry_oot, f"Duplicate {what} name: {reg_name}"
        op_cls.name = reg_name
        op_registry_oot[reg_name] = op_cls
        return op_cls

    if _decorated is None:
        return decorator
    if isinstance(_decorated, type):
        return decorator(_decorated)
    raise TypeError("Decorator can only be applied to classes.")


def _register(name):
    def decorator(op_cls):
        assert name not in op_registry, f"Duplicate op name: {name}"
        op_cls.name = name
        op_registry[name] = op_cls
        return op_cls
    return decorator


class PluggableLayer(nn.Module):
    """Whole-layer replacement through the same out-of-tree registry; no per-platform dispatch: calling
    the layer runs its `forward` only."""

    def __new__(cls, *args, **kwargs):
        target = op_registry_oot.get(cls.__name__, cls)
        return super().__new__(target)

    @classmethod
    def register(cls, name):
        return _register(name)

    @classmethod
    def register_oot(cls, _decorated_layer_cls=None, name=None):
        return _oot_decorator(cls, _decorated_layer_cls, name, "layer")


class CustomOp(nn.Module):
    """An op with per-platform forwards; the OOT registry swaps the class in __new__, then __init__ runs
    on the swapped-in class with the model's arguments."""

    def __new__(cls, *args, **kwargs):
        target = op_registry_oot.get(cls.__name__, cls)
        if target is not cls:
            logger.debug("Instantiating custom op: %s using %s", cls.__name__, target)
        return super().__new__(target)

    def __init__(self, *, enforce_enable=False, compile_native=False):
        super().__init__()
        self._enforce_enable = enforce_enable
        self._forward_method = self.dispatch_forward(compile_native=compile_native)

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cuda(self, *args, **kwargs):
        raise NotImplementedError

    def forward_hip(self, *args, **kwargs):
        return self.forward_cuda(*args, **kwargs)

    def forward_xpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_tpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_oot(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def dispatch_forward(self, compile_native=False):
        cc = get_cached_compilation_config()
        enabled = self._enforce_enable or self.enabled()
        (cc.enabled_custom_ops if enabled else cc.disabled_custom_ops).update([getattr(self.__class__, "name", type(self).__name__)])
        if not enabled:
            return self.forward_native      # (vLLM may torch.compile it; the double never does)
        if current_platform.is_rocm():
            return self.forward_hip
        if current_platform.is_cpu():
            return self.forward_cpu
        if current_platform.is_tpu():
            return self.forward_tpu
        if current_platform.is_xpu():
            return self.forward_xpu
        if current_platform.is_out_of_tree():
            return self.forward_oot
        return self.forward_cuda

    @classmethod
    def enabled(cls):
        custom_ops = get_cached_compilation_config().custom_ops
        if not hasattr(cls, "name"):
            logger.warning_once("Custom op %s was not registered, which means it won't appear in the op registry. "
                                "It will be enabled/disabled based on the global settings.", cls.__name__)
            return CustomOp.default_on()
        enabled, disabled = f"+{cls.name}" in custom_ops, f"-{cls.name}" in custom_ops
        assert not (enabled and disabled), f"Cannot enable and disable {cls.name}"
        return (CustomOp.default_on() or enabled) and not disabled

    @staticmethod
    def default_on():
        custom_ops = get_cached_compilation_config().custom_ops
        count_none, count_all = custom_ops.count("none"), custom_ops.count("all")
        assert count_none + count_all == 1
        return not count_none > 0 or count_all > 0

    @classmethod
    def register(cls, name):
        return _register(name)

    @classmethod
    def register_oot(cls, _decorated_op_cls=None, name=None):
        return _oot_decorator(cls, _decorated_op_cls, name, "op")
