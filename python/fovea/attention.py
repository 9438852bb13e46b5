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
    """FP8 scales for one prepare, in one of the four schemes of fovea's FP8 plan (docs/fp8.md §The plan),
    every address in the handle's memory (device memory for a GPU handle):
      Scales(fixed=p)         per tensor, static: float[3] q, k, v at p;
      Scales(state=p)         per tensor, dynamic: a 252-byte state (fresh_state_bytes) updated in place;
      Scales(fine=(k_mean, q_head, k_head, v_channel, qk_split))
                              robust, static: one layer's arrays (fp8_plan gives a file's; qk_split 0:
                              no pair split);
      Scales(robust_state=p)  robust, dynamic: a robust state (fresh_robust_state) updated in place.
    guard=p (static and robust static only): the static guard's counts, uint64[3] (q, k, v) at p, 8-byte
    aligned, kept across forwards: a tensor whose batch passes its fixed range is quantized with the
    batch's own scale instead of clipping, and counted (docs/fp8.md §Static guard)."""

    def __init__(self, fixed=None, state=None, fine=None, robust_state=None, guard=None):
        given = [x is not None for x in (fixed, state, fine, robust_state)]
        if sum(given) != 1:
            raise ValueError("fovea: give exactly one of fixed, state, fine and robust_state")
        if guard is not None and fixed is None and fine is None:
            raise ValueError("fovea: guard counts the static guard: give it with fixed or fine scales")
        self._fine = None
        if fine is not None:
            names = ("k_mean", "q_head", "k_head", "v_channel", "qk_split")
            if len(fine) != len(names):
                raise ValueError("fovea: fine is (k_mean, q_head, k_head, v_channel, qk_split) addresses")
            self._fine = _lib.Fine(*[_lib.pointer(f"fine.{n}", p) for n, p in zip(names, fine)])
        modes = (_lib.SCALES_STATIC, _lib.SCALES_DYNAMIC, _lib.SCALES_ROBUST_STATIC, _lib.SCALES_ROBUST_DYNAMIC)
        mode = modes[given.index(True)]  # in the order of the keywords
        self.arg = _lib.Scales(mode, _lib.pointer("fixed", fixed), _lib.pointer("state", state if state is not None
                                                                                  else robust_state),
                               ctypes.pointer(self._fine) if self._fine is not None else None,
                               _lib.pointer("guard", guard))


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


# ---- the robust scheme and the FP8 plan --------------------------------------------------------------

MODE_NAMES = {_lib.SCALES_STATIC: "static", _lib.SCALES_DYNAMIC: "dynamic",
              _lib.SCALES_ROBUST_STATIC: "robust_static", _lib.SCALES_ROBUST_DYNAMIC: "robust_dynamic"}


def split_pairs(head_dim):
    """Split pairs per head of the robust scheme at head_dim (6 at 72, 4 at 80, 0 elsewhere)."""
    return _lib.lib().fovea_attn_split_pairs(_lib.int32("head_dim", head_dim))


def robust_state_bytes(heads, head_dim):
    n = _lib.lib().fovea_attn_robust_state_bytes(_lib.int32("heads", heads), _lib.int32("head_dim", head_dim))
    if n < 0:
        raise ValueError(f"fovea: no robust state for {heads} heads x {head_dim} (both > 0, at most 65536 cells)")
    return n


def _aligned(raw):
    """bytes copied into an 8-byte-aligned ctypes buffer (the robust states hold doubles)."""
    buf = (ctypes.c_double * ((len(raw) + 7) // 8))()
    ctypes.memmove(buf, raw, len(raw))
    return buf


def fresh_robust_state(heads, head_dim):
    """A fresh robust state of one layer (empty rings and statistics) as bytes, 8-byte aligned in memory
    once copied into a tensor or array of its own."""
    n = robust_state_bytes(heads, head_dim)
    buf = (ctypes.c_double * ((n + 7) // 8))()
    _lib.check(_lib.lib().fovea_attn_robust_state_init(buf, n, heads, head_dim))
    return bytes(buf)[:n]


def robust_state_forwards(state, heads, head_dim):
    """The forwards a robust state (bytes, as forwards left it) has recorded: calibration writes after 16."""
    size = robust_state_bytes(heads, head_dim)
    raw = bytes(state)
    if len(raw) != size:
        raise ValueError(f"fovea: a robust state of {heads} heads x {head_dim} is {size} bytes, not {len(raw)}")
    n = ctypes.c_uint32()
    _lib.check(_lib.lib().fovea_attn_robust_state_forwards(_aligned(raw), size, heads, head_dim, ctypes.byref(n)))
    return n.value


def robust_calibrate(states, heads, head_dim, path, margin=1.5):
    """Writes `path` atomically from the layers' robust states (bytes each, as forwards left them):
    per-tensor q, k, v (what vLLM reads) and fovea's fine scales, x margin. Calibration is fovea's own
    (the same code as `fovea serve --mm-encoder-fp8-scale-save-path`)."""
    n = _lib.num_layers("the number of layers (states)", len(states))
    size = robust_state_bytes(heads, head_dim)
    raw = b"".join(bytes(s) for s in states)
    if len(raw) != n * size:
        raise ValueError(f"fovea: each robust state of {heads} heads x {head_dim} is {size} bytes")
    _lib.check(_lib.lib().fovea_attn_robust_calibrate(_aligned(raw), n, heads, head_dim, float(margin),
                                                      str(path).encode()))


def fp8_plan(scheme, num_layers, heads, head_dim, path=None, calibrating=False):
    """fovea's FP8 plan for num_layers layers of heads x head_dim (the rule of the fovea command's
    --fp8-scheme; docs/fp8.md §The plan): scheme "auto", "tensor" or "robust"; path a static scale
    file, or None for scales from the forwards (calibrating: they will be calibrated). Returns a dict:
    "modes" (per layer: "static", "dynamic", "robust_static", "robust_dynamic"), and with a file "qkv"
    ([[q, k, v], ...]) and "fine" (per layer: None, or a dict of its robust arrays as float / int lists:
    k_mean, q_head, k_head, v_channel, qk_split)."""
    n = _lib.num_layers("num_layers", num_layers)
    heads, head_dim = _lib.int32("heads", heads), _lib.int32("head_dim", head_dim)
    cells, pairs = heads * head_dim, heads * split_pairs(head_dim)
    modes = (ctypes.c_int32 * n)()
    qkv = (ctypes.c_float * (3 * n))()
    arrays = {"k_mean": (ctypes.c_float * (n * cells))(), "q_head": (ctypes.c_float * (n * heads))(),
              "k_head": (ctypes.c_float * (n * heads))(), "v_channel": (ctypes.c_float * (n * cells))(),
              "qk_split": (ctypes.c_int32 * max(1, n * pairs))()}
    rows = _lib.Fine(*[ctypes.addressof(a) for a in arrays.values()])
    _lib.check(_lib.lib().fovea_attn_fp8_plan(str(scheme).encode(), None if path is None else str(path).encode(),
                                              int(bool(calibrating)), n, heads, head_dim, modes, qkv,
                                              ctypes.byref(rows)))
    out = {"modes": [MODE_NAMES[m] for m in modes]}
    if path is not None:
        out["qkv"] = [list(qkv[3 * i:3 * i + 3]) for i in range(n)]
        width = {"k_mean": cells, "q_head": heads, "k_head": heads, "v_channel": cells, "qk_split": pairs}
        out["fine"] = [{k: list(a[l * width[k]:(l + 1) * width[k]]) for k, a in arrays.items()}
                       if out["modes"][l] == "robust_static" else None for l in range(n)]
    return out
