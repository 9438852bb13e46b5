"""ctypes binding of libfovea_attn.so (include/fovea/fovea_attn.h): the one place that knows the C ABI.

The library is found, in order: $FOVEA_ATTN_LIB (a path); a copy inside this package
(fovea/_lib/libfovea_attn.so*, for wheels that carry it); the build folder of the source tree this
package sits in (../build); the system loader (libfovea_attn.so.1 on LD_LIBRARY_PATH or ldconfig's
paths). Its ABI version must be the one this module was written for.

ctypes converts a Python int to a C integer or pointer by silently dropping the high bits
(ctypes.c_int32(2**32 + 5) is 5; ctypes.c_void_p(2**70) is NULL), so every int passes through
int32() / int64() / pointer() below on its way to a call: an integer that does not fit its C type is
an error naming the argument, never a different number.
"""
import ctypes
import glob
import operator
import os
import threading

ABI_VERSION = 3

OK, INVALID, UNSUPPORTED, RUNTIME = 0, 1, 2, 3
BF16, FP8 = 1, 2
AUTO, FOVEA, CUDNN, CPU = 0, 1, 2, 3
BACKEND_NAMES = {AUTO: "AUTO", FOVEA: "FOVEA", CUDNN: "CUDNN", CPU: "CPU"}
DEVICE_CPU = -1
SCALES_NONE, SCALES_STATIC, SCALES_DYNAMIC, SCALES_ROBUST_STATIC, SCALES_ROBUST_DYNAMIC = 0, 1, 2, 3, 4
HISTORY_LEN = 16
MAX_LAYERS = 4096  # FOVEA_ATTN_MAX_LAYERS: num_layers of the scale-file and calibration calls

INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
POINTER_MAX = 2 ** (8 * ctypes.sizeof(ctypes.c_void_p)) - 1


class FoveaError(RuntimeError):
    """A call into libfovea_attn failed; the message is the library's."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class FoveaUnsupportedError(FoveaError):
    """Valid, but not on this build, GPU or backend (FP8 off Hopper, a head_dim the kernels lack)."""


class RangeError(ValueError, OverflowError):
    """An integer argument that does not fit the C type it is passed as (or the range the library takes)."""


def integer(name, value):
    """value as an int: ints and integer types (numpy's, bool) only; a float is refused, never truncated."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"fovea: {name} must be an integer, got {type(value).__name__} {value!r}") from None


def int32(name, value):
    v = integer(name, value)
    if not INT32_MIN <= v <= INT32_MAX:
        raise RangeError(f"fovea: {name} = {v} does not fit int32")
    return v


def int64(name, value):
    v = integer(name, value)
    if not INT64_MIN <= v <= INT64_MAX:
        raise RangeError(f"fovea: {name} = {v} does not fit int64")
    return v


def pointer(name, value):
    """An address (an int, 0 or None for NULL) as a c_void_p."""
    if value is None:
        return ctypes.c_void_p()
    v = integer(name, value)
    if not 0 <= v <= POINTER_MAX:
        raise RangeError(f"fovea: {name} = {v} is not an address (0 .. 2^{8 * ctypes.sizeof(ctypes.c_void_p)} - 1)")
    return ctypes.c_void_p(v)


def num_layers(name, value):
    """A layer count as the library takes it (1 .. MAX_LAYERS), checked before anything is sized by it."""
    v = integer(name, value)
    if not 1 <= v <= MAX_LAYERS:
        raise RangeError(f"fovea: {name} = {v} is outside [1, {MAX_LAYERS}] (FOVEA_ATTN_MAX_LAYERS)")
    return v


class AmaxHistory(ctypes.Structure):
    _fields_ = [("ring", ctypes.c_float * HISTORY_LEN), ("pos", ctypes.c_int32), ("filled", ctypes.c_int32),
                ("updates", ctypes.c_uint32), ("nonfinite", ctypes.c_uint32), ("scale", ctypes.c_float)]


class AmaxState(ctypes.Structure):
    """One layer's dynamic-scaling state (q, k, v): 252 bytes, 4-byte aligned."""
    _fields_ = [("t", AmaxHistory * 3)]


class View(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("stride_token", ctypes.c_int64), ("stride_head", ctypes.c_int64)]


class Fine(ctypes.Structure):
    """fovea_attn_fine (one layer's robust arrays) and fovea_attn_fine_rows (every layer's): five addresses."""
    _fields_ = [("k_mean", ctypes.c_void_p), ("q_head", ctypes.c_void_p), ("k_head", ctypes.c_void_p),
                ("v_channel", ctypes.c_void_p), ("qk_split", ctypes.c_void_p)]


class Scales(ctypes.Structure):
    _fields_ = [("mode", ctypes.c_int32), ("fixed", ctypes.c_void_p), ("state", ctypes.c_void_p),
                ("fine", ctypes.POINTER(Fine)), ("guard", ctypes.c_void_p)]


assert ctypes.sizeof(AmaxState) == 252


def _candidates():
    env = os.environ.get("FOVEA_ATTN_LIB")
    if env:
        return [env]  # given explicitly: nothing else is tried
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_lib", "libfovea_attn.so*")))
    found += [os.path.join(here, "..", "..", "build", "libfovea_attn.so")]
    return found + ["libfovea_attn.so.1"]


_lock = threading.Lock()
_lib = None

# fovea_attn_set_allocator's callbacks: alloc(bytes, device, ctx) -> pointer or NULL; free(ptr, bytes, device, ctx).
AllocFn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_void_p)
FreeFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_void_p)


def _declare(lib):
    i32, i64, vp, f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    handle_p = ctypes.POINTER(vp)
    sigs = {
        "fovea_attn_abi_version": (i32, []),
        "fovea_attn_version": (ctypes.c_char_p, []),
        "fovea_attn_last_error": (ctypes.c_char_p, []),
        "fovea_attn_amax_state_init": (None, [ctypes.POINTER(AmaxState)]),
        "fovea_attn_create": (i32, [i32, i32, i32, i32, i32, handle_p]),
        "fovea_attn_destroy": (None, [vp]),
        "fovea_attn_backend_of": (i32, [vp]),
        "fovea_attn_plan": (i32, [vp, ctypes.POINTER(i32), i32, vp]),
        "fovea_attn_plan_capacity": (i32, [vp, i64, i32, i32]),
        "fovea_attn_schedule": (i32, [vp, vp, i32, vp]),
        "fovea_attn_layout_error": (i32, [vp, vp, ctypes.POINTER(i32)]),
        "fovea_attn_prepare": (i32, [vp, ctypes.POINTER(View), ctypes.POINTER(View), ctypes.POINTER(View),
                                     ctypes.POINTER(Scales), f32, vp]),
        "fovea_attn_prepare_fused": (i32, [vp, vp, i64, vp, vp, ctypes.POINTER(Scales), vp]),
        "fovea_attn_attend": (i32, [vp, ctypes.POINTER(View), vp]),
        "fovea_attn_scale_file_read": (i32, [ctypes.c_char_p, i32, ctypes.POINTER(f32)]),
        "fovea_attn_scale_file_write": (i32, [ctypes.c_char_p, i32, ctypes.POINTER(f32)]),
        "fovea_attn_calibrated_scales": (i32, [ctypes.POINTER(AmaxState), i32, f32, ctypes.POINTER(f32)]),
        "fovea_attn_set_allocator": (i32, [AllocFn, FreeFn, vp]),
        "fovea_attn_split_pairs": (i32, [i32]),
        "fovea_attn_robust_state_bytes": (i64, [i32, i32]),
        "fovea_attn_robust_state_init": (i32, [vp, i64, i32, i32]),
        "fovea_attn_robust_state_forwards": (i32, [vp, i64, i32, i32, ctypes.POINTER(ctypes.c_uint32)]),
        "fovea_attn_robust_calibrate": (i32, [vp, i32, i32, i32, f32, ctypes.c_char_p]),
        "fovea_attn_fp8_plan": (i32, [ctypes.c_char_p, ctypes.c_char_p, i32, i32, i32, i32, ctypes.POINTER(i32),
                                      ctypes.POINTER(f32), ctypes.POINTER(Fine)]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def lib():
    """The loaded library (loaded once, on first use)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        errors = []
        for path in _candidates():
            if os.sep in path and not os.path.exists(path):
                errors.append(f"{path}: no such file")
                continue
            try:
                candidate = ctypes.CDLL(path)
            except OSError as e:
                errors.append(f"{path}: {e}")
                continue
            try:
                _declare(candidate)
            except AttributeError as e:
                errors.append(f"{path}: not fovea's attention library ({e})")
                continue
            version = candidate.fovea_attn_abi_version()
            if version != ABI_VERSION:
                raise ImportError(f"fovea: {path} has ABI version {version}; this package speaks version "
                                  f"{ABI_VERSION} (rebuild the library or reinstall the package from the same checkout)")
            _lib = candidate
            return _lib
        raise ImportError("fovea: libfovea_attn.so not found (build it with CMake and set FOVEA_ATTN_LIB to its "
                          "path; docs/python.md). Tried:\n  " + "\n  ".join(errors))


def check(status):
    """Raises the library's last error for a failing status."""
    if status == OK:
        return
    message = lib().fovea_attn_last_error().decode("utf-8", "replace")
    raise (FoveaUnsupportedError if status == UNSUPPORTED else FoveaError)(status, message)


def version():
    return lib().fovea_attn_version().decode()
