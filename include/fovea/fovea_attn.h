/* fovea/fovea_attn.h: the C ABI of fovea's attention (libfovea_attn.so; docs/python.md).
 *
 * Packed varlen ("THD") non-causal attention over segments, in BF16 or FP8 (E4M3 Q, K, V and P with
 * per-tensor scales), for callers that are not C++: the Python package's ctypes layer, torch ops,
 * other runtimes. Plain C: no C++ types, no exceptions cross it; every call returns a status and a
 * failing call leaves a message for fovea_attn_last_error().
 *
 * One handle per (dtype, heads, head_dim, device). Its life:
 *   fovea_attn_create -> fovea_attn_plan (per batch shape: host segment offsets; may allocate; not
 *   capturable) -> fovea_attn_prepare or fovea_attn_prepare_fused -> fovea_attn_attend, repeated;
 *   prepare and attend make no host synchronization and can be captured in a CUDA graph once the
 *   handle has been planned (and, for fovea_attn_prepare, run once) outside the capture.
 * A handle is used by one thread and one stream at a time; it keeps scratch memory of its own (the
 * padded, quantized Q, K and V^T) between prepare and attend.
 *
 * Devices: device >= 0 is a CUDA device (every pointer is device memory of that device; `stream` is
 * a cudaStream_t, NULL for the legacy default stream). FOVEA_ATTN_DEVICE_CPU runs the CPU reference
 * (the emulation the GPU kernels are tested against) on host memory, for tests without a GPU.
 * Backends follow the fovea command's rules and messages: AUTO is FOVEA on Hopper (sm_90) and CUDNN
 * (BF16 only, cuDNN 9.15+) on other GPUs; FP8 needs FOVEA.
 *
 * Tensors are bf16 (as uint16 bits) [tokens, heads, head_dim] views: strides in elements, the last
 * dimension contiguous.
 *
 * Nothing a caller passes is trusted (FOVEA_ATTN_INVALID, with the last error naming the argument or
 * field, and nothing written): enums, null and misaligned pointers (bf16 data 2-byte, floats, int32
 * and states 4-byte aligned), the order of calls, and every size the caller's numbers make. Sizes are
 * computed with overflow checks and must stay within PTRDIFF_MAX bytes: a token's q, k and v
 * (3 x heads x head_dim x 8 bytes, the widest element the library keeps: the CPU reference's fp64),
 * that times the token count, and the extent of every view ((tokens - 1) x stride_token +
 * (heads - 1) x stride_head + head_dim elements of 2 bytes; within that, a view is the caller's word
 * for its buffer, as any pointer is). Host-memory FP8 state is checked before it is read or written
 * (fovea_attn_amax_state below); device memory is not read by the host (the calls make no host
 * synchronization), so a GPU handle trusts the contents of its scale buffers. */
#ifndef FOVEA_FOVEA_ATTN_H
#define FOVEA_FOVEA_ATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on any incompatible change of a signature, a struct or a constant below (2: the robust
 * scheme's scale modes and fovea_attn_scales.fine; 3: fovea_attn_scales.guard). */
#define FOVEA_ATTN_ABI_VERSION 3

typedef enum {
  FOVEA_ATTN_OK = 0,
  FOVEA_ATTN_INVALID = 1,     /* a bad argument: shape, stride, size, pointer, state, order of calls */
  FOVEA_ATTN_UNSUPPORTED = 2, /* valid, but not on this build, GPU or backend (FP8 off Hopper, ...) */
  FOVEA_ATTN_RUNTIME = 3,     /* CUDA, cuDNN or file I/O failed */
} fovea_attn_status;

typedef enum { FOVEA_ATTN_BF16 = 1, FOVEA_ATTN_FP8 = 2 } fovea_attn_dtype;
typedef enum { FOVEA_ATTN_AUTO = 0, FOVEA_ATTN_FOVEA = 1, FOVEA_ATTN_CUDNN = 2, FOVEA_ATTN_CPU = 3 } fovea_attn_backend;
#define FOVEA_ATTN_DEVICE_CPU (-1)

/* How prepare finds the FP8 scales of one layer (dequantization scales: x8 = sat(rne(x / s))): the
 * four schemes of fovea's FP8 plan (docs/fp8.md §The plan). */
typedef enum {
  FOVEA_ATTN_SCALES_NONE = 0,           /* BF16 */
  FOVEA_ATTN_SCALES_STATIC = 1,         /* `fixed`: float[3] (q, k, v), finite and > 0 (checked on a CPU handle) */
  FOVEA_ATTN_SCALES_DYNAMIC = 2,        /* `state`: a fovea_attn_amax_state, recorded and read in place */
  FOVEA_ATTN_SCALES_ROBUST_STATIC = 3,  /* `fine`: the layer's robust scales, fixed (a calibrated file's) */
  FOVEA_ATTN_SCALES_ROBUST_DYNAMIC = 4, /* `state`: a robust state (below), recorded and read in place */
} fovea_attn_scale_mode;

/* The robust scheme's scales of one layer (docs/fp8.md §Outlier channels): K is quantized about its
 * mean, Q and K with one scale per head, V with one per channel, and the split pairs of each head
 * (rotary pairs whose Q and K products keep about 2^-8 instead of E4M3's 2^-4:
 * fovea_attn_split_pairs(head_dim) per head, 6 at head_dim 72, 4 at 80, 8 at 64 and 128; qk_split NULL
 * splits none, as all -1 does). Every array is in the
 * handle's memory (device memory for a GPU handle); a CPU handle checks them: k_mean finite, the
 * scales finite and > 0, each head's split pairs -1 or distinct pairs in [0, head_dim / 2). */
typedef struct {
  const float* k_mean;     /* [heads * head_dim] */
  const float* q_head;     /* [heads] */
  const float* k_head;     /* [heads] (of K minus k_mean) */
  const float* v_channel;  /* [heads * head_dim] */
  const int32_t* qk_split; /* [heads * fovea_attn_split_pairs(head_dim)], or NULL: no pair split */
} fovea_attn_fine;

/* The static guard (docs/fp8.md §Static guard), for STATIC and ROBUST_STATIC: with `guard` set, a
 * forward first takes the batch's statistics and, where a tensor's amax passes a fixed scale's range
 * (448 x s; per head or channel for the robust arrays), quantizes that tensor with the batch's own
 * scale instead of clipping, and adds 1 to guard[0], [1] or [2] (q, k, v) for each tensor it
 * switched. The fixed scales are never written. guard is uint64[3] in the handle's memory, 8-byte
 * aligned, kept by the caller across forwards (zero it to start); NULL runs the scales as given,
 * without the statistics pass. It is refused with the dynamic modes. */
typedef struct {
  int32_t mode;                /* fovea_attn_scale_mode */
  const float* fixed;          /* STATIC: in the handle's memory (device memory for a GPU handle) */
  void* state;                 /* DYNAMIC, ROBUST_DYNAMIC: a state in the handle's memory */
  const fovea_attn_fine* fine; /* ROBUST_STATIC: host memory; its arrays in the handle's memory */
  uint64_t* guard;             /* STATIC, ROBUST_STATIC: NULL, or the static guard's counts (above) */
} fovea_attn_scales;

/* Dynamic scaling of one tensor: the last 16 finite amax values (max |x|); a forward records its
 * own amax, then quantizes with s = max(ring) / 448, floored at FLT_MIN (it cannot overflow).
 * Non-finite amax values are counted and never enter the ring.
 * A state is what fovea_attn_amax_state_init and forwards leave: 0 <= pos < 16, 0 <= filled <= 16,
 * pos == filled until the ring has wrapped (filled == 16), and ring[0 .. filled) finite and >= 0;
 * updates, nonfinite (counters that wrap modulo 2^32) and scale (an output) may hold anything. A state
 * that breaks this is refused with the field named ("amax_state.t[1].pos (k's ring position) =
 * 1073741824 is outside [0, 16)"; "states[2].t[0]..." for fovea_attn_calibrated_scales) where it is
 * host memory: CPU handles and fovea_attn_calibrated_scales. A GPU handle's state is device memory,
 * which the call does not read: it must come from fovea_attn_amax_state_init and forwards. */
#define FOVEA_ATTN_HISTORY_LEN 16
typedef struct {
  float ring[FOVEA_ATTN_HISTORY_LEN];
  int32_t pos;        /* next slot */
  int32_t filled;     /* valid slots */
  uint32_t updates;   /* forwards recorded, finite or not */
  uint32_t nonfinite; /* non-finite amax values ignored */
  float scale;        /* the scale of the latest forward */
} fovea_attn_amax_history;
typedef struct {
  fovea_attn_amax_history t[3]; /* q, k, v */
} fovea_attn_amax_state;        /* 252 bytes, 4-byte aligned */

/* Dynamic scaling of the robust scheme, one layer: a block of fovea_attn_robust_state_bytes(heads,
 * head_dim) bytes, 8-byte aligned, which fovea_attn_robust_state_init writes in host memory (a GPU
 * handle's is that block copied to device memory) and forwards update in place. It holds rings of the
 * last 16 finite forwards' amax per head of Q and of K minus that forward's mean, and per channel of V,
 * and, over every finite forward recorded, K's sum and range and Q's amax per channel (what
 * calibration writes from). A forward quantizes K minus its own mean, Q and K with max(ring) / 448 per
 * head, V per channel, its own amax included, and splits its own largest pairs (as fovea's encoder
 * does). The block starts with its shape, which the host-side calls check (CPU handles and
 * fovea_attn_robust_calibrate: "robust state: heads 8, not 16"), as they check its counters and
 * rings; a GPU handle does not read device memory: its state must come from init and forwards. */
int64_t fovea_attn_robust_state_bytes(int32_t heads, int32_t head_dim); /* -1 for invalid sizes */
int32_t fovea_attn_robust_state_init(void* state, int64_t bytes, int32_t heads, int32_t head_dim);
/* The forwards a host-memory robust state has recorded (finite or not; what calibration counts to 16),
 * into *forwards, the block checked as fovea_attn_robust_calibrate checks it. */
int32_t fovea_attn_robust_state_forwards(const void* state, int64_t bytes, int32_t heads, int32_t head_dim,
                                         uint32_t* forwards);
/* Split pairs per head of the robust scheme at this head_dim (6 at 72, 4 at 80, 0 elsewhere). */
int32_t fovea_attn_split_pairs(int32_t head_dim);

typedef struct {
  void* data;           /* bf16 */
  int64_t stride_token; /* elements between tokens */
  int64_t stride_head;  /* elements between heads */
} fovea_attn_view;

typedef struct fovea_attn fovea_attn;

int32_t fovea_attn_abi_version(void); /* FOVEA_ATTN_ABI_VERSION of the library */
const char* fovea_attn_version(void); /* fovea's version, e.g. "0.1.0" */
/* The message of the calling thread's last failing call ("" if none); valid until its next call. */
const char* fovea_attn_last_error(void);

/* A fresh dynamic state (empty rings, scales at the floor), written to host memory. */
void fovea_attn_amax_state_init(fovea_attn_amax_state* state);

/* heads > 0, head_dim even and > 0, and a token's q, k and v (3 x heads x head_dim x 8 bytes) within
 * PTRDIFF_MAX; a GPU backend has its own head_dim limits (UNSUPPORTED). */
int32_t fovea_attn_create(int32_t dtype, int32_t backend, int32_t heads, int32_t head_dim, int32_t device,
                          fovea_attn** out);
void fovea_attn_destroy(fovea_attn* h);             /* NULL is a no-op */
int32_t fovea_attn_backend_of(const fovea_attn* h); /* the resolved backend */

/* cu_seqlens: host int32 [num_segments + 1], 0 = cu[0] < cu[1] < ... = total tokens. Entries are read
 * in order and the call is refused at the first out of order ("cu_seqlens[2] = 3 is not above
 * cu_seqlens[1] = 5"), or when total tokens x 3 x heads x head_dim x 8 bytes exceeds PTRDIFF_MAX; a
 * refused plan leaves the handle unplanned. */
int32_t fovea_attn_plan(fovea_attn* h, const int32_t* cu_seqlens, int32_t num_segments, void* stream);

/* Segments read on the device (FOVEA backend; the others: UNSUPPORTED). fovea_attn_plan_capacity
 * sizes the handle for any layout of at most max_tokens tokens (the views of prepare and attend
 * then span max_tokens tokens) in at most max_segments segments; max_seqlen (0: max_tokens) is the
 * longest segment expected and only picks the tile size. It allocates: not capturable. Then, before
 * each prepare, fovea_attn_schedule enqueues a step that reads cu_seqlens, DEVICE int32
 * [num_segments + 1] with num_segments <= max_segments, when it runs: 0, then non-decreasing offsets
 * up to max_tokens, then only zeros after a drop (a buffer zeroed, then the real offsets copied to
 * its front); equal offsets are empty segments. Tokens past the last offset are not attended (their
 * output rows are not written). A layout that breaks these rules attends nothing, and
 * fovea_attn_layout_error (which waits for the stream) writes 1 + the index of its first bad entry
 * to *out (0: valid). schedule, prepare and attend make no host synchronization: captured once in a
 * CUDA graph, they replay whatever layout the buffer holds at each replay. */
int32_t fovea_attn_plan_capacity(fovea_attn* h, int64_t max_tokens, int32_t max_segments, int32_t max_seqlen);
int32_t fovea_attn_schedule(fovea_attn* h, const int32_t* cu_seqlens, int32_t num_segments, void* stream);
int32_t fovea_attn_layout_error(fovea_attn* h, void* stream, int32_t* out);

/* Q, K, V as three views (after RoPE). softmax_scale: 0 for 1/sqrt(head_dim), the only scale the
 * kernels take; any other value is refused. */
int32_t fovea_attn_prepare(fovea_attn* h, const fovea_attn_view* q, const fovea_attn_view* k, const fovea_attn_view* v,
                           const fovea_attn_scales* scales, float softmax_scale, void* stream);
/* fovea's fused path: the qkv projection's output [tokens, 3, heads, head_dim] (token stride in
 * elements, >= 3 * heads * head_dim, a multiple of 8; 16-byte aligned) and Qwen3-VL's 2D RoPE
 * tables fp32 [tokens, head_dim / 2] (the angle of columns d and d + head_dim / 2), or both NULL. */
int32_t fovea_attn_prepare_fused(fovea_attn* h, const void* qkv, int64_t token_stride, const float* rope_cos,
                                 const float* rope_sin, const fovea_attn_scales* scales, void* stream);
/* The output of the last prepare, bf16 [tokens, heads, head_dim]. */
int32_t fovea_attn_attend(fovea_attn* h, const fovea_attn_view* out, void* stream);

/* Device memory for the handles' buffers (planned data, staging copies) from the caller's allocator,
 * e.g. a framework's caching allocator, whose memory accounting then sees them: alloc returns `bytes`
 * on `device` (the current CUDA device), or NULL, which fails the call that needed it as
 * cudaErrorMemoryAllocation would; free takes back what alloc gave. Both set installs it for buffers made from now
 * on; both NULL returns to cudaMalloc; one NULL is INVALID. A buffer goes back to the allocator that
 * made it while that allocator is installed; once it is replaced, its buffers are not freed through
 * it (left to the process's end: it may be gone). Buffers are made at plan time and when a strided
 * view first needs staging, never during a CUDA graph capture. Process-wide; no-op in a CPU-only
 * build. */
typedef void* (*fovea_attn_alloc_fn)(size_t bytes, int32_t device, void* ctx);
typedef void (*fovea_attn_free_fn)(void* ptr, size_t bytes, int32_t device, void* ctx);
int32_t fovea_attn_set_allocator(fovea_attn_alloc_fn alloc, fovea_attn_free_fn free_fn, void* ctx);

/* ---- scale files (vLLM's format: {"<layer prefix>": {"q": s, "k": s, "v": s}, ...}) ---------------
 * num_layers is 1..FOVEA_ATTN_MAX_LAYERS in the three calls below (a caller sizes qkv and states by it:
 * check it before allocating). Read: every layer 0..num_layers-1 must be present (keys name the block:
 * "...blocks.<i>..."). */
#define FOVEA_ATTN_MAX_LAYERS 4096
int32_t fovea_attn_scale_file_read(const char* path, int32_t num_layers, float* qkv /* [num_layers * 3] */);
/* Written atomically (a temporary file, then rename), with fovea's layer names. */
int32_t fovea_attn_scale_file_write(const char* path, int32_t num_layers, const float* qkv);
/* Calibration: s * margin per layer from host copies of the layers' dynamic states, as fovea's own
 * calibration computes it; a layer whose ring is empty is an error naming it. */
int32_t fovea_attn_calibrated_scales(const fovea_attn_amax_state* states, int32_t num_layers, float margin,
                                     float* qkv /* [num_layers * 3] */);

/* Robust calibration, from host copies of num_layers consecutive robust states (as forwards left
 * them, each fovea_attn_robust_state_bytes long): writes `path` atomically with every layer's
 * per-tensor q, k, v (what vLLM reads) and fovea's fine fields, scales x margin, and the statistic
 * `auto` chooses layers by (fovea_robust_gain). A layer that recorded no finite forward is an error
 * naming it, and nothing is written. */
int32_t fovea_attn_robust_calibrate(const void* states, int32_t num_layers, int32_t heads, int32_t head_dim,
                                    float margin, const char* path);

/* ---- the FP8 plan: which scheme each layer runs --------------------------------------------------
 * fovea's rule (the command's --fp8-scheme), for num_layers layers of heads x head_dim: scheme
 * "tensor", "robust" or "auto"; `path` a static scale file, or NULL for scales from the forwards
 * (`calibrating` nonzero when they are to be calibrated). Writes modes[num_layers] (a
 * fovea_attn_scale_mode per layer) and, with a file, qkv [num_layers * 3] (its per-tensor scales) and,
 * where a layer is ROBUST_STATIC, its arrays into `fine`, layer-major (layer l's k_mean at
 * k_mean + l * heads * head_dim, q_head at q_head + l * heads, ...; the other layers' rows zero, their
 * split pairs -1). The rule:
 *   tensor: STATIC with a file, else DYNAMIC;
 *   robust: ROBUST_STATIC on every layer (the file must have fine scales), else ROBUST_DYNAMIC;
 *   auto:   with a file, ROBUST_STATIC on the layers whose calibration measured outlier channels
 *           (fovea_robust_gain >= 2) and STATIC on the rest; calibrating, ROBUST_DYNAMIC (its file then
 *           records that statistic); else DYNAMIC.
 * A file's fine scales are checked against heads and head_dim (the error names the layer). */
typedef struct {
  float* k_mean;     /* [num_layers * heads * head_dim] */
  float* q_head;     /* [num_layers * heads] */
  float* k_head;     /* [num_layers * heads] */
  float* v_channel;  /* [num_layers * heads * head_dim] */
  int32_t* qk_split; /* [num_layers * heads * fovea_attn_split_pairs(head_dim)]; NULL where that is 0 */
} fovea_attn_fine_rows;
int32_t fovea_attn_fp8_plan(const char* scheme, const char* path, int32_t calibrating, int32_t num_layers,
                            int32_t heads, int32_t head_dim, int32_t* modes, float* qkv,
                            const fovea_attn_fine_rows* fine);

#ifdef __cplusplus
}
#endif
#endif /* FOVEA_FOVEA_ATTN_H */
