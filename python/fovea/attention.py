"""fovea's attention through its C ABI, without torch: handles over raw pointers, FP8 state, scale files.

`fovea.torch` builds its ops on this module; it is also what a runtime other than torch would use
(pointers from CuPy, JAX's DLPack, or host arrays for the CPU reference).

Every integer is range-checked before it reaches ctypes (which would drop its high bits): one that
does not fit its C type raises fovea._lib.RangeError (a ValueError and an OverflowError) naming the
argument, e.g. "cu_seqlens[1] = 4294967301 does not fit int32"; a float where an integer belongs is a
TypeError. What fits is then checked by the library (FoveaError, status INVALID, naming the field).
"""
import ctypes
import math

from . import _lib

_DTYPES = {"bf16": _lib.BF16, "fp8": _lib.FP8}
_BACKENDS = {"auto": _lib.AUTO, "fovea": _lib.FOVEA, "cudnn": _lib.CUDNN, "cpu": _lib.CPU}


def _view(name, view):
    ptr, stride_token, stride_head = view
    return _lib.View(_lib.pointer(f"{name}.data", ptr), _lib.int64(f"{name}.stride_token", stride_token),
                     _lib.int64(f"{name}.stride_head", stride_head))


class Attention:
    """One handle of libfovea_attn: (dtype, heads, head_dim, device), planned for one batch shape.

    device: a CUDA device index, or "cpu" for the CPU reference on host memory. Pointers are ints
    (addresses); views are (ptr, stride_token, stride_head) in bf16 elements, the last dimension
    contiguous; `stream` is a cudaStream_t as an int (0: the legacy default stream).
    """

    def __init__(self, dtype, heads, head_dim, device=0, backend="auto"):
        if dtype not in _DTYPES:
            raise ValueError(f"fovea: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        if str(backend).lower() not in _BACKENDS:
            raise ValueError(f"fovea: backend {backend!r} is not one of {sorted(_BACKENDS)}")
        self.dtype, self.heads, self.head_dim = dtype, _lib.int32("heads", heads), _lib.int32("head_dim", head_dim)
        self.device = _lib.DEVICE_CPU if device == "cpu" else _lib.int32("device", device)
        self._h = ctypes.c_void_p()
        self._lib = _lib.lib()
        _lib.check(self._lib.fovea_attn_create(_DTYPES[dtype], _BACKENDS[str(backend).lower()], self.heads,
                                               self.head_dim, self.device, ctypes.byref(self._h)))
        self.backend = _lib.BACKEND_NAMES[self._lib.fovea_attn_backend_of(self._h)]
        self.cu_seqlens = None

    def close(self):
        if self._h:
            self._lib.fovea_attn_destroy(self._h)
            self._h = ctypes.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def plan(self, cu_seqlens, stream=0):
        """cu_seqlens: host integers, 0 = cu[0] < cu[1] < ... = total tokens."""
        cu = [_lib.int32(f"cu_seqlens[{i}]", x) for i, x in enumerate(cu_seqlens)]
        segments = _lib.int32("number of segments", len(cu) - 1)
        arr = (ctypes.c_int32 * len(cu))(*cu)
        _lib.check(self._lib.fovea_attn_plan(self._h, arr, segments, _lib.pointer("stream", stream)))
        self.cu_seqlens = tuple(cu)

    def plan_capacity(self, max_tokens, max_segments, max_seqlen=0):
        """Sized for any layout of at most max_tokens tokens in at most max_segments segments, read on the
        device by schedule() (FOVEA backend only). max_seqlen (0: max_tokens) only picks the tile size."""
        _lib.check(self._lib.fovea_attn_plan_capacity(self._h, _lib.int64("max_tokens", max_tokens),
                                                      _lib.int32("max_segments", max_segments),
                                                      _lib.int32("max_seqlen", max_seqlen)))
        self.cu_seqlens = None

    def schedule(self, cu_seqlens, segments, stream=0):
        """cu_seqlens: the address of DEVICE int32 [segments + 1], read when the step runs (capturable)."""
        _lib.check(self._lib.fovea_attn_schedule(self._h, _lib.pointer("cu_seqlens", cu_seqlens),
                                                 _lib.int32("segments", segments), _lib.pointer("stream", stream)))

    def layout_error(self, stream=0):
        """0 if the last scheduled layout was valid, else 1 + the index of its first bad entry (waits)."""
        out = ctypes.c_int32()
        _lib.check(self._lib.fovea_attn_layout_error(self._h, _lib.pointer("stream", stream), ctypes.byref(out)))
        return out.value

    def prepare(self, q, k, v, scales=None, softmax_scale=0.0, stream=0):
        """q, k, v: (ptr, stride_token, stride_head) views after RoPE. scales: Scales or None (BF16)."""
        views = [_view(name, x) for name, x in (("q", q), ("k", k), ("v", v))]
        _lib.check(self._lib.fovea_attn_prepare(self._h, *[ctypes.byref(x) for x in views],
                                                _scales_arg(scales), float(softmax_scale or 0.0),
                                                _lib.pointer("stream", stream)))

    def prepare_fused(self, qkv, token_stride, rope_cos=0, rope_sin=0, scales=None, stream=0):
        """qkv: pointer to [tokens, 3, heads, head_dim] bf16; rope tables fp32 [tokens, head_dim / 2] or 0."""
        _lib.check(self._lib.fovea_attn_prepare_fused(self._h, _lib.pointer("qkv", qkv), _lib.int64("token_stride", token_stride),
                                                      _lib.pointer("rope_cos", rope_cos), _lib.pointer("rope_sin", rope_sin),
                                                      _scales_arg(scales), _lib.pointer("stream", stream)))

    def attend(self, out, stream=0):
        """out: (ptr, stride_token, stride_head) bf16 view."""
        view = _view("out", out)
        _lib.check(self._lib.fovea_attn_attend(self._h, ctypes.byref(view), _lib.pointer("stream", stream)))


class Scales:
    """FP8 scales for one prepare: static (a float[3] q, k, v at `fixed`) or dynamic (a state at `state`),
    both addresses in the handle's memory."""

    def __init__(self, fixed=None, state=None):
        if (fixed is None) == (state is None):
            raise ValueError("fovea: give static scales or a dynamic state, not both or neither")
        self.arg = _lib.Scales(_lib.SCALES_STATIC if fixed is not None else _lib.SCALES_DYNAMIC,
                               _lib.pointer("fixed", fixed), _lib.pointer("state", state))


def _scales_arg(scales):
    return None if scales is None else ctypes.byref(scales.arg)


# ---- dynamic state and scale files -----------------------------------------------------------------

STATE_BYTES = ctypes.sizeof(_lib.AmaxState)


def fresh_state_bytes():
    """A fresh dynamic state (empty rings, scales at the floor) as 252 bytes."""
    st = _lib.AmaxState()
    _lib.lib().fovea_attn_amax_state_init(ctypes.byref(st))
    return bytes(st)


def state_from_bytes(raw):
    """A state's bytes (from device memory) as an AmaxState (.t[0..2]: q, k, v; ring, filled, scale...)."""
    if len(raw) != STATE_BYTES:
        raise ValueError(f"fovea: a dynamic state is {STATE_BYTES} bytes, got {len(raw)}")
    return _lib.AmaxState.from_buffer_copy(raw)


def read_scale_file(path, num_layers):
    """vLLM's scale file: [[q, k, v], ...] for layers 0..num_layers-1 (keys name "...blocks.<i>...").
    num_layers is 1 .. fovea._lib.MAX_LAYERS, checked before the result is allocated."""
    num_layers = _lib.num_layers("num_layers", num_layers)
    out = (ctypes.c_float * (3 * num_layers))()
    _lib.check(_lib.lib().fovea_attn_scale_file_read(str(path).encode(), num_layers, out))
    return [list(out[3 * i:3 * i + 3]) for i in range(num_layers)]


def write_scale_file(path, scales):
    """Writes [[q, k, v], ...] atomically in vLLM's format with fovea's layer names."""
    n = _lib.num_layers("the number of layers (rows of scales)", len(scales))
    flat = [float(x) for row in scales for x in row]
    if len(flat) != 3 * n:
        raise ValueError("fovea: scales must be [[q, k, v], ...]")
    arr = (ctypes.c_float * len(flat))(*flat)
    _lib.check(_lib.lib().fovea_attn_scale_file_write(str(path).encode(), n, arr))


def calibrated_scales(states, margin=1.5):
    """s * margin per layer from the layers' dynamic states (bytes each), as fovea's calibration computes it."""
    n = _lib.num_layers("the number of layers (states)", len(states))
    arr = (_lib.AmaxState * n)(*[state_from_bytes(bytes(s)) for s in states])
    out = (ctypes.c_float * (3 * n))()
    _lib.check(_lib.lib().fovea_attn_calibrated_scales(arr, n, float(margin), out))
    return [list(out[3 * i:3 * i + 3]) for i in range(n)]


def default_softmax_scale(head_dim):
    return 1.0 / math.sqrt(head_dim)
