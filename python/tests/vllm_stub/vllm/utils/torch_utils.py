import contextlib


@contextlib.contextmanager
def set_default_torch_dtype(dtype):
    """Sets the default torch dtype for the block (the model's weight and activation dtype)."""
    import torch
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
