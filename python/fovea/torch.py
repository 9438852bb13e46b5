"""fovea's attention as torch ops (torch.library custom ops with fake kernels; docs/python.md).

    out = fovea.torch.varlen_attention(q, k, v, cu_seqlens)                      # BF16
    out = fovea.torch.varlen_attention(q, k, v, cu_seqlens, descale=d)           # FP8, static scales
    out = fovea.torch.varlen_attention(q, k, v, cu_seqlens, amax_state=s)        # FP8, dynamic scaling
    out = fovea.torch.varlen_attention(q, k, v, cu_seqlens, **book.layer(i))     # FP8 by the book's plan

q, k, v: [total_tokens, heads, head_dim] bf16 on one device (last dimension contiguous, any other
strides: views of a fused qkv output are read in place); cu_seqlens: int32 [segments + 1]; returns
[total_tokens, heads, head_dim] bf16. descale: float32 [3] (q, k, v dequantization scales); amax_state:
a 252-byte tensor (ScaleBook makes them) that the op updates in place (its 16-entry amax history).
The robust scheme (docs/fp8.md §Outlier channels) takes fine=(k_mean, q_head, k_head, v_channel,
qk_split) (a calibrated file's arrays; qk_split None: no pair split) or
robust_state= (a uint8 tensor of fovea.attention.robust_state_bytes(heads, head_dim), updated in place);
ScaleBook(..., scheme=) gives each layer the scheme fovea's plan chooses.

    out = fovea.torch.varlen_attention_qkv(qkv, cu_seqlens, rope_cos, rope_sin, ...)  # fused qkv + RoPE

The ops are torch.ops.fovea.varlen_attention[_dynamic] and varlen_attention_qkv[_dynamic], opaque to
torch.compile (no graph break) with fake kernels for tracing; the dynamic ops declare their mutation,
so the state can live in a CUDA graph. Plain eager calls (no compile, no dispatch mode, no gradient)
run the same implementation without torch.library's dispatch, which costs ~30 us a call.

Segments: a cu_seqlens on the GPU (FOVEA backend, Hopper) is never read back: the handle is planned for
a capacity (the token count and the number of segments) and a step on the device reads the offsets at
every call, so a CUDA graph captured once replays whatever layout the tensor holds then. Offsets may
end before the token count and repeat (empty segments), or drop to zeros after the real ones; tokens
past the last offset are not attended and come out as zeros; an invalid layout attends nothing
(zeros), and it is not checked on the host (that would read the tensor back). A cu_seqlens on the
CPU, or any on the CUDNN backend, is read on the host, 0 to the token count, and planned exactly; on
the GPU it is then read once per tensor (a host sync) and remembered while it is unchanged. A shape
runs once before a CUDA graph capture (planning allocates).
"""
import atexit
import collections
import threading
import weakref
from typing import Optional

import torch

from . import _lib
from . import attention as _fa

__all__ = ["varlen_attention", "varlen_attention_qkv", "ScaleBook", "FoveaError", "FoveaUnsupportedError", "clear_cache", "remember_offsets"]

FoveaError, FoveaUnsupportedError = _lib.FoveaError, _lib.FoveaUnsupportedError
STATE_INTS = _fa.STATE_BYTES // 4
_CACHE_SIZE = 16

_lock = threading.Lock()
_handles = collections.OrderedDict()  # (device, dtype, heads, head_dim, cu) -> [Attention, pinned]
_seen = {}                           # id(tensor) -> (weakref, version, host offsets)
_by_address = {}                     # (device, address, numel) -> host offsets last read there
_no_capacity = set()                 # handle keys whose backend plans from host offsets only


def clear_cache():
    """Drops every planned handle not used in a CUDA graph capture, and the remembered offsets."""
    with _lock:
        for key in [k for k, v in _handles.items() if not v[1]]:
            del _handles[key]
        _seen.clear()
        _by_address.clear()
        _no_capacity.clear()


def _capturing(t):
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _version_of(cu):
    try:
        return cu._version
    except RuntimeError:  # an inference tensor keeps no version: its offsets are read every time
        return None


def _remember(cu, version, host):
    """Keeps a device cu_seqlens' host offsets: for the tensor while its version holds, and for its
    address (what a CUDA graph capture, which cannot read it, looks up)."""
    with _lock:
        if version is not None:
            key = id(cu)
            _seen[key] = (weakref.ref(cu, lambda _, k=key: _seen.pop(k, None)), version, host)
        if cu.is_cuda:
            if len(_by_address) >= 256:
                _by_address.clear()
            _by_address[(cu.device.index, cu.data_ptr(), cu.numel())] = host


def _normalized(cu):
    # vLLM pads cu_seqlens with repeats (empty segments) for its encoder CUDA graphs: they hold no token.
    out = [cu[0]]
    for x in cu[1:]:
        if x != out[-1]:
            out.append(x)
    return tuple(out)


def _host_offsets(cu):
    if cu.device.type == "cpu":
        return _normalized([int(x) for x in cu.tolist()])
    version = _version_of(cu)
    key = id(cu)
    with _lock:
        hit = _seen.get(key)
        if hit and version is not None and hit[0]() is cu and hit[1] == version:
            return hit[2]
    address = (cu.device.index, cu.data_ptr(), cu.numel())
    if _capturing(cu):
        with _lock:
            if address in _by_address:
                return _by_address[address]
        raise RuntimeError("fovea: cu_seqlens is on the GPU and cannot be read during a CUDA graph capture; run the "
                           "same call once before capturing (or pass cu_seqlens on the CPU)")
    host = _normalized([int(x) for x in cu.tolist()])
    _remember(cu, version, host)
    return host


_allocator = []  # the installed callbacks (kept alive while the library may call them)


def _torch_alloc(nbytes, device, ctx):
    try:
        return torch.cuda.caching_allocator_alloc(nbytes, device, torch.cuda.current_stream(device))
    except Exception:  # out of memory: NULL, and the library's call fails naming the allocation
        return None


def _torch_free(ptr, nbytes, device, ctx):
    try:
        torch.cuda.caching_allocator_delete(ptr)
    except Exception:
        pass


def _install_allocator():
    """fovea's device buffers come from torch's caching allocator, so torch's memory accounting (and
    vLLM's profile run, which sizes the KV cache from it) sees them. Installed on the first GPU handle;
    at exit every handle is dropped first, then the allocator uninstalled, so no buffer is freed
    through torch once the interpreter is going away."""
    with _lock:
        if _allocator:
            return
        fns = [_lib.AllocFn(_torch_alloc), _lib.FreeFn(_torch_free)]
        _lib.check(_lib.lib().fovea_attn_set_allocator(fns[0], fns[1], None))
        _allocator.extend(fns)
    atexit.register(_uninstall_allocator)


def _uninstall_allocator():
    with _lock:
        _handles.clear()
    _lib.lib().fovea_attn_set_allocator(_lib.AllocFn(), _lib.FreeFn(), None)


def _cached(key, make):
    """The handle cached under `key`, else make()'s, cached; None (remembered) where make() returns None. A
    handle used in a CUDA graph capture is pinned (the graph holds its buffers); one cannot be made during a
    capture (planning allocates)."""
    capturing = key[0] == "cuda" and torch.cuda.is_current_stream_capturing()
    with _lock:
        entry = _handles.get(key)
        if entry:
            _handles.move_to_end(key)
            entry[1] = entry[1] or capturing  # a graph holds its buffers: never evicted
            return entry[0]
        if key in _no_capacity:
            return None
    if capturing:
        raise RuntimeError("fovea: this attention shape was not planned before the CUDA graph capture (planning "
                           "allocates); run the same call once before capturing")
    if key[0] == "cuda":
        _install_allocator()
    att = make()
    with _lock:
        if att is None:
            _no_capacity.add(key)
            return None
        _handles[key] = [att, False]
        unpinned = [k for k, v in _handles.items() if not v[1]]
        for old in unpinned[:max(0, len(unpinned) - _CACHE_SIZE)]:
            del _handles[old]
    return att


def _handle(device, fp8, heads, head_dim, cu, stream):
    """The handle planned from host offsets `cu`."""
    def make():
        att = _fa.Attention("fp8" if fp8 else "bf16", heads, head_dim,
                            device="cpu" if device.type == "cpu" else device.index)
        att.plan(cu, stream)
        return att
    return _cached((device.type, device.index, fp8, heads, head_dim, cu), make)


def _capacity_handle(device, fp8, heads, head_dim, n, segments):
    """The GPU handle planned by capacity for (n tokens, segments), or None where its backend cannot read
    segments on the device (CUDNN: the caller plans from host offsets)."""
    def make():
        att = _fa.Attention("fp8" if fp8 else "bf16", heads, head_dim, device=device.index)
        if att.backend != "FOVEA":
            return None
        att.plan_capacity(n, segments)
        return att
    return _cached((device.type, device.index, fp8, heads, head_dim, ("capacity", n, segments)), make)


def _check(q, k, v, cu):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != torch.bfloat16:
            raise TypeError(f"fovea: {name} must be bfloat16, got {x.dtype}")
        if x.dim() != 3 or x.stride(2) != 1:
            raise ValueError(f"fovea: {name} must be [tokens, heads, head_dim] with the last dimension contiguous, "
                             f"got shape {tuple(x.shape)} strides {x.stride()}")
        if x.device != q.device:
            raise ValueError(f"fovea: {name} is on {x.device}, q on {q.device}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"fovea: q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} "
                         "(no grouped-query attention)")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"fovea: cu_seqlens must be int32 [segments + 1], got {cu.dtype} {tuple(cu.shape)}")


_FP8_KWARGS = ("descale", "amax_state", "fine", "robust_state")


def _fp8_kwargs(descale, amax_state, fine, robust_state, guard=None):
    given = {k: v for k, v in zip(_FP8_KWARGS, (descale, amax_state, fine, robust_state)) if v is not None}
    if len(given) > 1:
        raise ValueError(f"fovea: give one of descale (static FP8), amax_state (dynamic), fine (robust static) and "
                         f"robust_state (robust dynamic), not {' and '.join(given)}")
    if fine is not None and len(fine) != 5:
        raise ValueError("fovea: fine is (k_mean, q_head, k_head, v_channel, qk_split) tensors")
    if guard is not None:
        if descale is None and fine is None:
            raise ValueError("fovea: guard counts the static guard: give it with descale or fine (static scales)")
        given["guard"] = guard
    return given


def _scales(device, fp8):
    """The Scales of one call's FP8 keyword (fp8: {} for BF16, else one of _FP8_KWARGS), checked."""
    def on_device(name, t, dtype, numel=None):
        if t.dtype != dtype or not t.is_contiguous() or t.device != device or (numel is not None and t.numel() != numel):
            raise ValueError(f"fovea: {name} must be a contiguous {dtype} tensor{f' of {numel} values' if numel else ''} "
                             f"on q's device, got {t.dtype} {tuple(t.shape)} on {t.device}")
        return t.data_ptr()
    guard = fp8.get("guard")
    if guard is not None:
        guard = on_device("guard (the static guard's q, k, v counts)", guard, torch.int64, 3)
    if "descale" in fp8:
        return _fa.Scales(fixed=on_device("descale (q, k, v)", fp8["descale"], torch.float32, 3), guard=guard)
    if "amax_state" in fp8:
        state = fp8["amax_state"]
        if state.numel() * state.element_size() != _fa.STATE_BYTES or not state.is_contiguous() or state.device != device:
            raise ValueError(f"fovea: amax_state must be a contiguous {_fa.STATE_BYTES}-byte tensor on q's device "
                             "(ScaleBook makes them)")
        return _fa.Scales(state=state.data_ptr())
    if "fine" in fp8:
        fine = fp8["fine"]  # five tensors: _fp8_kwargs checked
        names = ("k_mean", "q_head", "k_head", "v_channel")
        ptrs = [on_device(f"fine.{n}", t, torch.float32) for n, t in zip(names, fine[:4])]
        split = 0 if fine[4] is None else on_device("fine.qk_split", fine[4], torch.int32)
        return _fa.Scales(fine=ptrs + [split], guard=guard)
    if "robust_state" in fp8:
        return _fa.Scales(robust_state=on_device("robust_state", fp8["robust_state"], torch.uint8))
    return None


def _attend(device, n, heads, head_dim, cu_seqlens, scales, prepare):
    """Plans (or finds the plan), runs `prepare(att, stream)`, attends into a fresh [n, heads, head_dim]."""
    if n == 0:
        return torch.empty((n, heads, head_dim), dtype=torch.bfloat16, device=device)
    if device.type == "cuda" and cu_seqlens.device == device:
        stream = torch.cuda.current_stream(device).cuda_stream
        segments = cu_seqlens.numel() - 1
        att = _capacity_handle(device, scales is not None, heads, head_dim, n, segments)
        if att is not None:
            cu = cu_seqlens if cu_seqlens.is_contiguous() else cu_seqlens.contiguous()
            out = torch.zeros((n, heads, head_dim), dtype=torch.bfloat16, device=device)
            att.schedule(cu.data_ptr(), segments, stream)
            prepare(att, stream)
            att.attend((out.data_ptr(), heads * head_dim, head_dim), stream)
            return out
    out = torch.empty((n, heads, head_dim), dtype=torch.bfloat16, device=device)
    cu = _host_offsets(cu_seqlens)
    if cu[0] != 0 or cu[-1] != n:
        raise ValueError(f"fovea: cu_seqlens must run from 0 to the token count {n}, got {cu[0]} .. {cu[-1]}")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    att = _handle(device, scales is not None, heads, head_dim, cu, stream)
    prepare(att, stream)
    att.attend((out.data_ptr(), heads * head_dim, head_dim), stream)
    return out


def _run(q, k, v, cu_seqlens, fp8, softmax_scale):
    _check(q, k, v, cu_seqlens)
    n, heads, head_dim = q.shape
    scales = _scales(q.device, fp8)
    views = [(x.data_ptr(), x.stride(0), x.stride(1)) for x in (q, k, v)]
    return _attend(q.device, n, heads, head_dim, cu_seqlens, scales,
                   lambda att, stream: att.prepare(*views, scales=scales, softmax_scale=softmax_scale, stream=stream))


def _run_qkv(qkv, cu_seqlens, rope_cos, rope_sin, fp8):
    if qkv.dtype != torch.bfloat16 or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"fovea: qkv must be bfloat16 [tokens, 3, heads, head_dim], got {qkv.dtype} {tuple(qkv.shape)}")
    n, _, heads, head_dim = qkv.shape
    if qkv.stride()[1:] != (heads * head_dim, head_dim, 1):
        raise ValueError(f"fovea: qkv's (3, heads, head_dim) must be contiguous within a token, got strides {qkv.stride()}")
    if (rope_cos is None) != (rope_sin is None):
        raise ValueError("fovea: give both RoPE tables or neither")
    for name, t in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (n, head_dim // 2) or not t.is_contiguous()
                              or t.device != qkv.device):
            raise ValueError(f"fovea: {name} must be contiguous float32 [tokens, head_dim / 2] = [{n}, {head_dim // 2}] "
                             f"on qkv's device, got {t.dtype} {tuple(t.shape)}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"fovea: cu_seqlens must be int32 [segments + 1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    scales = _scales(qkv.device, fp8)
    cos, sin = (0 if t is None else t.data_ptr() for t in (rope_cos, rope_sin))
    return _attend(qkv.device, n, heads, head_dim, cu_seqlens, scales,
                   lambda att, stream: att.prepare_fused(qkv.data_ptr(), qkv.stride(0), cos, sin, scales=scales, stream=stream))


@torch.library.custom_op("fovea::varlen_attention", mutates_args=())
def _varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      descale: Optional[torch.Tensor], softmax_scale: float) -> torch.Tensor:
    return _run(q, k, v, cu_seqlens, _fp8_kwargs(descale, None, None, None), softmax_scale)


@_varlen_attention.register_fake
def _(q, k, v, cu_seqlens, descale, softmax_scale):
    return q.new_empty(q.shape, dtype=torch.bfloat16)


@torch.library.custom_op("fovea::varlen_attention_dynamic", mutates_args=("amax_state",))
def _varlen_attention_dynamic(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              amax_state: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    return _run(q, k, v, cu_seqlens, {"amax_state": amax_state}, softmax_scale)


@_varlen_attention_dynamic.register_fake
def _(q, k, v, cu_seqlens, amax_state, softmax_scale):
    return q.new_empty(q.shape, dtype=torch.bfloat16)


@torch.library.custom_op("fovea::varlen_attention_qkv", mutates_args=())
def _varlen_attention_qkv(qkv: torch.Tensor, cu_seqlens: torch.Tensor, rope_cos: Optional[torch.Tensor],
                          rope_sin: Optional[torch.Tensor], descale: Optional[torch.Tensor]) -> torch.Tensor:
    return _run_qkv(qkv, cu_seqlens, rope_cos, rope_sin, _fp8_kwargs(descale, None, None, None))


@_varlen_attention_qkv.register_fake
def _(qkv, cu_seqlens, rope_cos, rope_sin, descale):
    return qkv.new_empty((qkv.shape[0], qkv.shape[2], qkv.shape[3]), dtype=torch.bfloat16)


@torch.library.custom_op("fovea::varlen_attention_qkv_dynamic", mutates_args=("amax_state",))
def _varlen_attention_qkv_dynamic(qkv: torch.Tensor, cu_seqlens: torch.Tensor, rope_cos: Optional[torch.Tensor],
                                  rope_sin: Optional[torch.Tensor], amax_state: torch.Tensor) -> torch.Tensor:
    return _run_qkv(qkv, cu_seqlens, rope_cos, rope_sin, {"amax_state": amax_state})


@_varlen_attention_qkv_dynamic.register_fake
def _(qkv, cu_seqlens, rope_cos, rope_sin, amax_state):
    return qkv.new_empty((qkv.shape[0], qkv.shape[2], qkv.shape[3]), dtype=torch.bfloat16)


# The robust scheme's ops: its static arrays (qk_split None: no pair split), and its
# dynamic state, mutated.
@torch.library.custom_op("fovea::varlen_attention_robust", mutates_args=())
def _varlen_attention_robust(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                             k_mean: torch.Tensor, q_head: torch.Tensor, k_head: torch.Tensor, v_channel: torch.Tensor,
                             qk_split: Optional[torch.Tensor], softmax_scale: float) -> torch.Tensor:
    return _run(q, k, v, cu_seqlens, {"fine": (k_mean, q_head, k_head, v_channel, qk_split)}, softmax_scale)


@_varlen_attention_robust.register_fake
def _(q, k, v, cu_seqlens, k_mean, q_head, k_head, v_channel, qk_split, softmax_scale):
    return q.new_empty(q.shape, dtype=torch.bfloat16)


@torch.library.custom_op("fovea::varlen_attention_robust_dynamic", mutates_args=("robust_state",))
def _varlen_attention_robust_dynamic(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                     robust_state: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    return _run(q, k, v, cu_seqlens, {"robust_state": robust_state}, softmax_scale)


@_varlen_attention_robust_dynamic.register_fake
def _(q, k, v, cu_seqlens, robust_state, softmax_scale):
    return q.new_empty(q.shape, dtype=torch.bfloat16)


@torch.library.custom_op("fovea::varlen_attention_qkv_robust", mutates_args=())
def _varlen_attention_qkv_robust(qkv: torch.Tensor, cu_seqlens: torch.Tensor, rope_cos: Optional[torch.Tensor],
                                 rope_sin: Optional[torch.Tensor], k_mean: torch.Tensor, q_head: torch.Tensor,
                                 k_head: torch.Tensor, v_channel: torch.Tensor,
                                 qk_split: Optional[torch.Tensor]) -> torch.Tensor:
    return _run_qkv(qkv, cu_seqlens, rope_cos, rope_sin, {"fine": (k_mean, q_head, k_head, v_channel, qk_split)})


@_varlen_attention_qkv_robust.register_fake
def _(qkv, cu_seqlens, rope_cos, rope_sin, k_mean, q_head, k_head, v_channel, qk_split):
    return qkv.new_empty((qkv.shape[0], qkv.shape[2], qkv.shape[3]), dtype=torch.bfloat16)


@torch.library.custom_op("fovea::varlen_attention_qkv_robust_dynamic", mutates_args=("robust_state",))
def _varlen_attention_qkv_robust_dynamic(qkv: torch.Tensor, cu_seqlens: torch.Tensor, rope_cos: Optional[torch.Tensor],
                                         rope_sin: Optional[torch.Tensor], robust_state: torch.Tensor) -> torch.Tensor:
    return _run_qkv(qkv, cu_seqlens, rope_cos, rope_sin, {"robust_state": robust_state})


@_varlen_attention_qkv_robust_dynamic.register_fake
def _(qkv, cu_seqlens, rope_cos, rope_sin, robust_state):
    return qkv.new_empty((qkv.shape[0], qkv.shape[2], qkv.shape[3]), dtype=torch.bfloat16)


# The static ops with the static guard: its counts (guard, int64 [3]) mutated.
@torch.library.custom_op("fovea::varlen_attention_guarded", mutates_args=("guard",))
def _varlen_attention_guarded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              descale: torch.Tensor, guard: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    return _run(q, k, v, cu_seqlens, _fp8_kwargs(descale, None, None, None, guard), softmax_scale)


@_varlen_attention_guarded.register_fake
def _(q, k, v, cu_seqlens, descale, guard, softmax_scale):
    return q.new_empty(q.shape, dtype=torch.bfloat16)


@torch.library.custom_op("fovea::varlen_attention_qkv_guarded", mutates_args=("guard",))
def _varlen_attention_qkv_guarded(qkv: torch.Tensor, cu_seqlens: torch.Tensor, rope_cos: Optional[torch.Tensor],
                                  rope_sin: Optional[torch.Tensor], descale: torch.Tensor,
                                  guard: torch.Tensor) -> torch.Tensor:
    return _run_qkv(qkv, cu_seqlens, rope_cos, rope_sin, _fp8_kwargs(descale, None, None, None, guard))


@_varlen_attention_qkv_guarded.register_fake
def _(qkv, cu_seqlens, rope_cos, rope_sin, descale, guard):
    return qkv.new_empty((qkv.shape[0], qkv.shape[2], qkv.shape[3]), dtype=torch.bfloat16)


@torch.library.custom_op("fovea::varlen_attention_robust_guarded", mutates_args=("guard",))
def _varlen_attention_robust_guarded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                     k_mean: torch.Tensor, q_head: torch.Tensor, k_head: torch.Tensor,
                                     v_channel: torch.Tensor, qk_split: Optional[torch.Tensor], guard: torch.Tensor,
                                     softmax_scale: float) -> torch.Tensor:
    fine = (k_mean, q_head, k_head, v_channel, qk_split)
    return _run(q, k, v, cu_seqlens, _fp8_kwargs(None, None, fine, None, guard), softmax_scale)


@_varlen_attention_robust_guarded.register_fake
def _(q, k, v, cu_seqlens, k_mean, q_head, k_head, v_channel, qk_split, guard, softmax_scale):
    return q.new_empty(q.shape, dtype=torch.bfloat16)


@torch.library.custom_op("fovea::varlen_attention_qkv_robust_guarded", mutates_args=("guard",))
def _varlen_attention_qkv_robust_guarded(qkv: torch.Tensor, cu_seqlens: torch.Tensor, rope_cos: Optional[torch.Tensor],
                                         rope_sin: Optional[torch.Tensor], k_mean: torch.Tensor, q_head: torch.Tensor,
                                         k_head: torch.Tensor, v_channel: torch.Tensor,
                                         qk_split: Optional[torch.Tensor], guard: torch.Tensor) -> torch.Tensor:
    fine = (k_mean, q_head, k_head, v_channel, qk_split)
    return _run_qkv(qkv, cu_seqlens, rope_cos, rope_sin, _fp8_kwargs(None, None, fine, None, guard))


@_varlen_attention_qkv_robust_guarded.register_fake
def _(qkv, cu_seqlens, rope_cos, rope_sin, k_mean, q_head, k_head, v_channel, qk_split, guard):
    return qkv.new_empty((qkv.shape[0], qkv.shape[2], qkv.shape[3]), dtype=torch.bfloat16)


_dispatch_stack = getattr(torch._C, "_len_torch_dispatch_stack", None)


def _eager(*tensors):
    """True where the op's implementation can be called directly: plain tensors needing no gradient, no
    torch.compile tracing and no dispatch mode (fake tensors, export, profilers' modes) active. There
    torch.library's dispatch adds ~30 us a call (bench/torch-peers.py) and nothing else."""
    return (_dispatch_stack is not None and not torch.compiler.is_compiling() and _dispatch_stack() == 0 and
            all(t is None or (type(t) is torch.Tensor and not t.requires_grad) for t in tensors))


def varlen_attention_qkv(qkv, cu_seqlens, rope_cos=None, rope_sin=None, *, descale=None, amax_state=None, fine=None,
                         robust_state=None, guard=None):
    """fovea's fused entry: the qkv projection's output [tokens, 3, heads, head_dim] bf16 (token stride
    a multiple of 8 elements, 16-byte aligned) and Qwen3-VL's 2D RoPE tables, float32 [tokens,
    head_dim / 2] (the angle of columns d and d + head_dim / 2), or neither: RoPE, quantization and
    layout in one step, as fovea's own encoder runs it. Returns [tokens, heads, head_dim] bf16.
    FP8 keywords as varlen_attention's."""
    fp8 = _fp8_kwargs(descale, amax_state, fine, robust_state, guard)
    if _eager(qkv, cu_seqlens, rope_cos, rope_sin, descale, amax_state, robust_state, guard, *(fine or ())):
        return _run_qkv(qkv, cu_seqlens, rope_cos, rope_sin, fp8)
    if amax_state is not None:
        return torch.ops.fovea.varlen_attention_qkv_dynamic(qkv, cu_seqlens, rope_cos, rope_sin, amax_state)
    if robust_state is not None:
        return torch.ops.fovea.varlen_attention_qkv_robust_dynamic(qkv, cu_seqlens, rope_cos, rope_sin, robust_state)
    if fine is not None:
        if guard is not None:
            return torch.ops.fovea.varlen_attention_qkv_robust_guarded(qkv, cu_seqlens, rope_cos, rope_sin, *fine, guard)
        return torch.ops.fovea.varlen_attention_qkv_robust(qkv, cu_seqlens, rope_cos, rope_sin, *fine)
    if guard is not None:
        return torch.ops.fovea.varlen_attention_qkv_guarded(qkv, cu_seqlens, rope_cos, rope_sin, descale, guard)
    return torch.ops.fovea.varlen_attention_qkv(qkv, cu_seqlens, rope_cos, rope_sin, descale)


def varlen_attention(q, k, v, cu_seqlens, max_seqlen=None, *, softmax_scale=None, descale=None, amax_state=None,
                     fine=None, robust_state=None, guard=None):
    """Packed varlen attention, non-causal within each segment. max_seqlen is accepted for
    flash_attn_varlen_func's callers and not needed. softmax_scale: None or 1/sqrt(head_dim).
    FP8: one of descale (static, float32 [3]), amax_state (dynamic), fine (robust static) and
    robust_state (robust dynamic); ScaleBook.layer(i) gives them. guard, with descale or fine: the
    static guard's counts, int64 [3] (q, k, v) on the device, added to where a batch passes the
    static range and is quantized with its own scale instead (docs/fp8.md §Static guard)."""
    del max_seqlen
    fp8 = _fp8_kwargs(descale, amax_state, fine, robust_state, guard)
    scale = 0.0 if softmax_scale is None else float(softmax_scale)
    if _eager(q, k, v, cu_seqlens, descale, amax_state, robust_state, guard, *(fine or ())):
        return _run(q, k, v, cu_seqlens, fp8, scale)
    if amax_state is not None:
        return torch.ops.fovea.varlen_attention_dynamic(q, k, v, cu_seqlens, amax_state, scale)
    if robust_state is not None:
        return torch.ops.fovea.varlen_attention_robust_dynamic(q, k, v, cu_seqlens, robust_state, scale)
    if fine is not None:
        if guard is not None:
            return torch.ops.fovea.varlen_attention_robust_guarded(q, k, v, cu_seqlens, *fine, guard, scale)
        return torch.ops.fovea.varlen_attention_robust(q, k, v, cu_seqlens, *fine, scale)
    if guard is not None:
        return torch.ops.fovea.varlen_attention_guarded(q, k, v, cu_seqlens, descale, guard, scale)
    return torch.ops.fovea.varlen_attention(q, k, v, cu_seqlens, descale, scale)


class ScaleBook(torch.nn.Module):
    """The FP8 scales of a model's attention layers as device tensors (module buffers, so a compiled
    graph treats them as static state):
      "dynamic"   amax_state [layers, 63] int32, one 252-byte state per layer, updated by every forward;
      "static"    descale [layers, 3] float32, read from `path` (vLLM's scale file);
      "calibrate" dynamic, and after 16 complete forwards maybe_save() writes `path` (s x margin).
    scheme: "tensor" (the default: per-tensor scales, as above), "robust" or "auto", chosen per layer by
    fovea's plan (fovea.attention.fp8_plan; docs/fp8.md §The plan), which needs heads and head_dim:
    robust layers keep robust_state [layers, bytes] uint8 (dynamic, calibrate; calibration then writes
    the fine scales too) or the file's arrays (static: k_mean, q_head, k_head, v_channel, qk_split).
    Static scales are guarded unless guard=False: a batch past a file's range is quantized with its own
    scale instead of clipping, and counted in guard [layers, 3] int64 (q, k, v; guarded() reads them).
    modes lists each layer's scheme; layer(i) gives the keyword arguments of varlen_attention for layer i."""

    def __init__(self, num_layers, mode="dynamic", path=None, margin=1.5, device="cuda", scheme="tensor", heads=None,
                 head_dim=None, guard=True):
        super().__init__()
        if mode not in ("dynamic", "static", "calibrate"):
            raise ValueError(f"fovea: ScaleBook mode {mode!r} is not one of dynamic, static, calibrate")
        if mode != "dynamic" and not path:
            raise ValueError(f"fovea: ScaleBook mode {mode!r} needs a path (the scale file to "
                             f"{'read' if mode == 'static' else 'write'})")
        if scheme != "tensor" and (heads is None or head_dim is None):
            raise ValueError(f"fovea: ScaleBook scheme {scheme!r} needs heads and head_dim (the robust scheme's sizes)")
        # Checked before anything is sized by it (a state is 252 bytes a layer).
        self.mode, self.path, self.margin, self.scheme = mode, path, float(margin), scheme
        self.num_layers = _lib.num_layers("num_layers", num_layers)
        self.heads, self.head_dim = heads, head_dim
        self.saved = False
        if scheme == "tensor":
            self.modes = ["static" if mode == "static" else "dynamic"] * self.num_layers
            rows = _fa.read_scale_file(path, self.num_layers) if mode == "static" else None
        else:
            plan = _fa.fp8_plan(scheme, self.num_layers, heads, head_dim, path=path if mode == "static" else None,
                                calibrating=mode == "calibrate")
            self.modes, rows = plan["modes"], plan.get("qkv")
        if rows is not None:
            self.register_buffer("descale", torch.tensor(rows, dtype=torch.float32, device=device))
        if mode == "static" and guard:
            self.register_buffer("guard", torch.zeros((self.num_layers, 3), dtype=torch.int64, device=device))
        if "dynamic" in self.modes:
            raw = bytearray(_fa.fresh_state_bytes() * self.num_layers)
            state = torch.frombuffer(raw, dtype=torch.int32).reshape(self.num_layers, STATE_INTS)
            self.register_buffer("amax_state", state.to(device))
        if "robust_dynamic" in self.modes:
            one = _fa.fresh_robust_state(heads, head_dim)
            state = torch.frombuffer(bytearray(one * self.num_layers), dtype=torch.uint8)
            self.register_buffer("robust_state", state.reshape(self.num_layers, len(one)).to(device))
        if "robust_static" in self.modes:
            zero = {"k_mean": [0.0] * (heads * head_dim), "q_head": [1.0] * heads, "k_head": [1.0] * heads,
                    "v_channel": [1.0] * (heads * head_dim), "qk_split": [-1] * (heads * _fa.split_pairs(head_dim))}
            for name, fill in zero.items():
                rows = [f[name] if f else fill for f in plan["fine"]]
                dtype = torch.int32 if name == "qk_split" else torch.float32
                self.register_buffer(f"fine_{name}", torch.tensor(rows, dtype=dtype, device=device))

    def layer(self, i):
        m = self.modes[i]
        guard = {"guard": self.guard[i]} if hasattr(self, "guard") else {}
        if m == "static":
            return {"descale": self.descale[i], **guard}
        if m == "dynamic":
            return {"amax_state": self.amax_state[i]}
        if m == "robust_dynamic":
            return {"robust_state": self.robust_state[i]}
        split = self.fine_qk_split[i] if self.fine_qk_split.shape[1] else None
        return {"fine": (self.fine_k_mean[i], self.fine_q_head[i], self.fine_k_head[i], self.fine_v_channel[i], split),
                **guard}

    def guarded(self):
        """The static guard's counts per layer, [[q, k, v], ...]: the forwards in which the guard
        quantized that tensor with the batch's own scale (the file's range was passed). Reads the
        device (a synchronization); all zero where the book is not static or guard=False."""
        if not hasattr(self, "guard"):
            return [[0, 0, 0] for _ in range(self.num_layers)]
        return self.guard.tolist()

    def states(self):
        """The layers' dynamic states on the host (fovea._lib.AmaxState: .t[0..2].ring, .filled, .scale...)."""
        raw = self.amax_state.cpu().numpy().tobytes()
        return [_fa.state_from_bytes(raw[i * _fa.STATE_BYTES:(i + 1) * _fa.STATE_BYTES]) for i in range(self.num_layers)]

    def complete_forwards(self):
        if "robust_dynamic" in self.modes:  # every layer is robust: its state counts the forwards
            raw = self.robust_state.cpu().numpy()
            return min(_fa.robust_state_forwards(raw[i].tobytes(), self.heads, self.head_dim)
                       for i in range(self.num_layers))
        return min(min(t.updates for t in st.t) for st in self.states())

    def calibrated(self, margin=None):
        """[[q, k, v], ...]: max(ring) / 448 x margin per layer (an error names a layer that saw no finite input)."""
        return _fa.calibrated_scales([bytes(s) for s in self.states()], self.margin if margin is None else margin)

    def save(self, path=None, margin=None):
        margin = self.margin if margin is None else margin
        if "robust_dynamic" in self.modes:
            states = [bytes(self.robust_state[i].cpu().numpy().tobytes()) for i in range(self.num_layers)]
            return _fa.robust_calibrate(states, self.heads, self.head_dim, path or self.path, margin)
        _fa.write_scale_file(path or self.path, self.calibrated(margin))

    def maybe_save(self):
        """Calibration: writes the file once, after the 16th complete forward; True that once."""
        if self.mode != "calibrate" or self.saved or self.complete_forwards() < _lib.HISTORY_LEN:
            return False
        self.save()
        self.saved = True
        return True


def remember_offsets(cu, host):
    """Tells the ops the host values of a device cu_seqlens they will see (vLLM's plugin: the offsets
    are on the host when the tensor is made), so no call reads them back."""
    _remember(cu, _version_of(cu), _normalized([_lib.int32(f"cu_seqlens[{i}]", x) for i, x in enumerate(host)]))
