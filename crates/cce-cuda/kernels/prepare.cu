// prepare.cu: a call's targets prepared and its inputs checked on the device, with no host
// read: the classes the loss kernels take, the count of valid rows, the per-row upstream
// gradient, and the first bad row of each check in a status buffer that the host reads only
// when it asks (src/backend/status.rs holds the layout and turns a record into a typed error).
//
// Parameters
//   status  u32 [64] (STATUS_BYTES): the call area (words 0..32, zeroed at each call's start)
//           and the sticky record (words 32..48, the first error since the host last read it).
//           Call area: [0] valid rows, [1] first out-of-range target, [2] first row whose
//           target the bias masks, [3] the bias masks some class, [4] first valid row,
//           [5] first non-finite lse, [6] first non-finite d_loss, [7] first non-finite d_lse;
//           [4] is kept only with a bias (it names label smoothing's masked-class error)
//           (rows as keys 0xFFFFFFFF − row, atomicMax, 0 = none); bytes 64..104: the filter
//           statistics (f64 [5], cce_dense_stats).
//           Sticky record: [32] kind (0 none, 1 target out of range, 2 all targets ignored,
//           3 target masked, 4 label smoothing over a masked class, 5 / 6 / 7 non-finite lse /
//           d_loss / d_lse), [33] row, [34..36) i64 value, [36] V, [37..39) i64 ignore_index,
//           [39] N, [40] shift (low word), [41] f32 label smoothing, [42] f32 value, [43] shift
//           (high word).
//   raw     the caller's targets, i32 or i64 [N]; classes i32 [N] out (−1: ignored, by
//           ignore_index, by shift, or a bad value: the loss kernels never see a class
//           outside [0, V)); bias f32 / f16 / bf16 [V] or null; dl f32 [N] out or null.
//
// Tiling
//   Grid-stride loops over rows or classes; the finishing kernel is one block.
//
// Thread mapping
//   One row (or class) per thread per step; one thread folds the call area into the record.

#define ST_NVALID 0
#define ST_BAD_TARGET 1
#define ST_MASKED_TARGET 2
#define ST_ANY_MASKED 3
#define ST_FIRST_VALID 4
#define ST_BAD_LSE 5
#define ST_BAD_DLOSS 6
#define ST_BAD_DLSE 7
#define ST_KIND 32

__device__ __forceinline__ u32 row_key(i64 row) { return 0xFFFFFFFFu - (u32)row; }
__device__ __forceinline__ i64 key_row(u32 key) { return (i64)(0xFFFFFFFFu - key); }

// −inf in the bias's dtype, by bit pattern (0: f32, 1: f16, 2: bf16).
__device__ __forceinline__ bool bias_neg_inf(const void* bias, int dt, i64 j) {
    if (dt == 0) return ((const u32*)bias)[j] == 0xFF800000u;
    const u16 h = ((const u16*)bias)[j];
    return dt == 1 ? h == 0xFC00u : h == 0xFF80u;
}

template <typename T>
__device__ __forceinline__ void prepare_targets(const T* raw, i64 n, i64 seq_len, i64 shift,
                                                i64 ignore_index, i64 v, const void* bias,
                                                int bias_dt, int* classes, u32* status) {
    u32 valid = 0;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        const i64 value = (i64)raw[i];
        if (value != ignore_index && (value < 0 || value >= v))
            atomicMax(&status[ST_BAD_TARGET], row_key(i));
        const i64 pos = i % seq_len;
        int cls = -1;
        if (shift < seq_len - pos) {
            const i64 y = (i64)raw[i + shift];
            if (y != ignore_index && y >= 0 && y < v) cls = (int)y;
        }
        classes[i] = cls;
        if (cls >= 0) {
            ++valid;
            // The first valid row names the label-smoothing error, which needs a masking bias:
            // without a bias no row contends for this word.
            if (bias) {
                atomicMax(&status[ST_FIRST_VALID], row_key(i));
                if (bias_neg_inf(bias, bias_dt, cls))
                    atomicMax(&status[ST_MASKED_TARGET], row_key(i));
            }
        }
    }
    // One atomic per warp.
    for (int o = 16; o > 0; o >>= 1) valid += __shfl_down_sync(0xFFFFFFFFu, valid, o);
    if ((threadIdx.x & 31) == 0 && valid) atomicAdd(&status[ST_NVALID], valid);
}

#define PREP_PARAMS                                                                               \
    i64 n, i64 seq_len, i64 shift, i64 ignore_index, i64 v, const void *bias, int bias_dt,        \
        int *classes, u32 *status
extern "C" __global__ void cce_prepare_targets_i32(const int* raw, PREP_PARAMS) {
    prepare_targets<int>(raw, n, seq_len, shift, ignore_index, v, bias, bias_dt, classes, status);
}
extern "C" __global__ void cce_prepare_targets_i64(const i64* raw, PREP_PARAMS) {
    prepare_targets<i64>(raw, n, seq_len, shift, ignore_index, v, bias, bias_dt, classes, status);
}

// status[3] = 1 when some class of the bias is −inf.
extern "C" __global__ void cce_prepare_bias_masked(const void* bias, int bias_dt, i64 v,
                                                   u32* status) {
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < v;
         j += (i64)gridDim.x * blockDim.x)
        if (bias_neg_inf(bias, bias_dt, j)) {
            status[ST_ANY_MASKED] = 1u;
            return;
        }
}

// The first row of x (f32 [N]) that is not finite into status[slot]; for the lse (lse_rule
// 1), a −inf at an ignored row is allowed when the bias masks some class (every class of that
// row may be masked: its loss is not taken).
extern "C" __global__ void cce_check_rows_finite(const float* x, i64 n, const int* classes,
                                                 int lse_rule, int slot, u32* status) {
    const bool masked = lse_rule && status[ST_ANY_MASKED] != 0u;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        const float xi = x[i];
        if (isfinite(xi)) continue;
        if (masked && __float_as_uint(xi) == 0xFF800000u && classes[i] < 0) continue;
        atomicMax(&status[slot], row_key(i));
    }
}

// Writes the sticky record (kind, row, i64 value, f32 value) and the call's context.
__device__ void record_error(u32* status, u32 kind, i64 row, i64 value, float fvalue, i64 v,
                             i64 ignore_index, i64 n, u64 shift, float label_smoothing) {
    // 64-bit values as two words (low first): word 37 is not 8-byte aligned.
    status[ST_KIND + 1] = (u32)row;
    status[ST_KIND + 2] = (u32)(u64)value;
    status[ST_KIND + 3] = (u32)((u64)value >> 32);
    status[ST_KIND + 4] = (u32)v;
    status[ST_KIND + 5] = (u32)(u64)ignore_index;
    status[ST_KIND + 6] = (u32)((u64)ignore_index >> 32);
    status[ST_KIND + 7] = (u32)n;
    status[ST_KIND + 8] = (u32)shift;
    status[ST_KIND + 11] = (u32)(shift >> 32);
    status[ST_KIND + 9] = __float_as_uint(label_smoothing);
    status[ST_KIND + 10] = __float_as_uint(fvalue);
    status[ST_KIND] = kind;
}

// Folds the call area into the sticky record (when it holds none), in the order the host
// checks them: target values, a mean over no valid row, masked targets (and label smoothing
// over a masked class, at the first valid row), non-finite d_loss, d_lse, lse. Then, when dl
// is given, dl[i] = g / valid rows for a mean (0 when no row is valid), g otherwise, at valid
// rows; 0 at ignored rows. One block.
extern "C" __global__ void cce_prepare_finish(u32* status, const void* raw, int raw_i64,
                                              const int* classes, const float* lse,
                                              const float* dloss, const float* dlse, i64 n,
                                              i64 v, i64 ignore_index, u64 shift, int mean,
                                              float label_smoothing, float g, float* dl) {
    __shared__ float s;
    if (threadIdx.x == 0) {
        const u32 n_valid = status[ST_NVALID];
        s = mean ? (n_valid ? g / (float)n_valid : 0.0f) : g;
        if (status[ST_KIND] == 0u) {
            const u32 bad = status[ST_BAD_TARGET];
            const u32 masked = status[ST_MASKED_TARGET];
            const u32 first = status[ST_FIRST_VALID];
            const bool smooth_masked =
                label_smoothing > 0.0f && status[ST_ANY_MASKED] != 0u && first != 0u;
            #define REC(kind, row, value, fvalue)                                                 \
                record_error(status, kind, row, value, fvalue, v, ignore_index, n, shift,         \
                             label_smoothing)
            if (bad) {
                const i64 row = key_row(bad);
                const i64 value = raw_i64 ? ((const i64*)raw)[row] : (i64)((const int*)raw)[row];
                REC(1u, row, value, 0.0f);
            } else if (mean && n_valid == 0u) {
                REC(2u, 0, 0, 0.0f);
            } else if (smooth_masked && masked != first) {
                REC(4u, key_row(first), 0, 0.0f);
            } else if (masked) {
                const i64 row = key_row(masked);
                REC(3u, row, (i64)classes[row], 0.0f);
            } else if (status[ST_BAD_DLOSS]) {
                const i64 row = key_row(status[ST_BAD_DLOSS]);
                REC(6u, row, 0, dloss[row]);
            } else if (status[ST_BAD_DLSE]) {
                const i64 row = key_row(status[ST_BAD_DLSE]);
                REC(7u, row, 0, dlse[row]);
            } else if (status[ST_BAD_LSE]) {
                const i64 row = key_row(status[ST_BAD_LSE]);
                REC(5u, row, 0, lse[row]);
            }
            #undef REC
        }
    }
    __syncthreads();
    if (!dl) return;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) dl[i] = classes[i] >= 0 ? s : 0.0f;
}
