"""current_platform: CUDA, with a simulated compute capability for tests (simulate_device_capability)."""
import contextlib
from typing import NamedTuple


class DeviceCapability(NamedTuple):
    major: int
    minor: int

    def to_int(self):
        return self.major * 10 + self.minor


class CudaPlatform:
    simulated_capability = None   # (major, minor) or None: the real GPU's
    out_of_tree = False           # True: dispatch_forward picks forward_oot

    def is_cuda(self):
        return not self.out_of_tree

    def is_rocm(self):
        return False

    def is_cpu(self):
        return False

    def is_tpu(self):
        return False

    def is_xpu(self):
        return False

    def is_out_of_tree(self):
        return self.out_of_tree

    def get_device_capability(self, device_id=0):
        if self.simulated_capability is not None:
            return DeviceCapability(*self.simulated_capability)
        import torch
        return DeviceCapability(*torch.cuda.get_device_capability(device_id))

    def has_device_capability(self, capability, device_id=0):
        cap = self.get_device_capability(device_id)
        want = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return cap.to_int() >= want


current_platform = CudaPlatform()


@contextlib.contextmanager
def simulate_device_capability(capability):
    """Makes the GPU look like `capability` (e.g. (8, 9), Ada: FP8 but not Hopper) to vLLM's platform and to
    torch.cuda.get_device_capability, whichever a plugin asks."""
    import torch
    real = torch.cuda.get_device_capability
    old = current_platform.simulated_capability
    current_platform.simulated_capability = tuple(capability)
    torch.cuda.get_device_capability = lambda device=None: tuple(capability)
    try:
        yield
    finally:
        current_platform.simulated_capability = old
        torch.cuda.get_device_capability = real
