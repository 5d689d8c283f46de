// forward.cu: the forward row kernels of the dense engine, (2) over a row chunk's logits and
// (2') over class tiles. Concatenated after dense_common.cu (its types, conversions,
// reductions and row outputs) into one NVRTC module (src/dense/mod.rs `KERNEL_SOURCE`).
//
// Parameters: L f32 [rows, ld] logits (row stride ld, a multiple of 8) or a class tile of them;
//   per-row arrays (targets, lse, rest, loss, entropy, argmax) chunk-relative; details at each
//   kernel.
// Tiling: (2) one block per row; (2') one warp per row, CLS_ROWS rows per block.
// Thread mapping: float4 columns per thread (coalesced 16-byte loads), block / warp reductions
//   in a fixed order (bitwise deterministic).

// ------------------------------------------------------------------------------------------
// (2) Forward row kernel
// ------------------------------------------------------------------------------------------
// Parameters:
//   L        f32 [rows, ld] logits of the chunk (read only), row-major, 16-byte aligned rows;
//   bias     DT [V] or 0;  targets i32 [rows] (class or −1), chunk-relative;
//   lse, rest (1 − p_y, write_row_outputs), loss, entropy (f32 [rows]), argmax (i32 [rows])
//   outputs, chunk-relative; entropy and argmax may be 0. loss = per-row ℓ_i (0 at ignored
//   rows).
// Tiling: one block per row; the row is streamed in steps of FWD_THREADS·4·FWD_UNROLL columns.
// Thread mapping: thread t owns columns 4·t + k·4·FWD_THREADS (float4 loads, coalesced across
// the warp), FWD_UNROLL loads in flight per thread; the scalar tail (V mod 4) one per thread.
#define FWD_THREADS 256
#define FWD_UNROLL 4

template <int DT>
__device__ __forceinline__ void dense_fwd(const float* __restrict__ L, long long ld, int V,
                                          const void* __restrict__ bias, float softcap,
                                          const int* __restrict__ targets, float alpha,
                                          float lambda, float* lse_out, float* rest_out,
                                          float* loss_out, float* ent_out, int* am_out) {
    __shared__ RowAcc sh[32];
    const long long r = blockIdx.x;
    const float* Lr = L + r * ld;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const int V4 = V & ~3;
    const int y = targets[r];
    RowAcc a;
    acc_init(a);
    for (int base = threadIdx.x * 4; base < V4; base += FWD_THREADS * 4 * FWD_UNROLL) {
        float4 xv[FWD_UNROLL];
#pragma unroll
        for (int u = 0; u < FWD_UNROLL; ++u) {
            int j = base + u * FWD_THREADS * 4;
            xv[u] = j < V4 ? gemm_logit4(__ldg((const float4*)(Lr + j)))
                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        if (bias) {
#pragma unroll
            for (int u = 0; u < FWD_UNROLL; ++u) {
                int j = base + u * FWD_THREADS * 4;
                if (j < V4) {
                    float4 b = Elem<DT>::load4(bias, j);
                    xv[u].x += b.x; xv[u].y += b.y; xv[u].z += b.z; xv[u].w += b.w;
                }
            }
        }
        if (softcap > 0.0f) {
#pragma unroll
            for (int u = 0; u < FWD_UNROLL; ++u)
#pragma unroll
                for (int k = 0; k < 4; ++k) f4set(xv[u], k, cap_z(f4get(xv[u], k), softcap, inv_cap));
        }
        acc_push_batch<FWD_UNROLL>(a, xv, base, FWD_THREADS * 4, V4, y);
    }
    for (int j = V4 + threadIdx.x; j < V; j += FWD_THREADS) {
        float x = gemm_logit(Lr[j]);
        if (bias) x += Elem<DT>::load(bias, j);
        acc_push(a, cap_z(x, softcap, inv_cap), j, y);
    }
    a = block_acc(a, sh);
    if (threadIdx.x == 0) {
        float zy = 0.0f;
        if (y >= 0) {
            float x = Lr[y];
            if (bias) x += Elem<DT>::load(bias, y);
            zy = cap_z(x, softcap, inv_cap);
        }
        write_row_outputs(r, y, a.m, a.s, zy, a.zs, a.t, a.am, alpha, lambda, V, lse_out,
                          rest_out, loss_out, ent_out, am_out);
    }
}

#define FWD_PARAMS                                                                            \
    const float *__restrict__ L, long long ld, int V, const void *__restrict__ bias,         \
        float softcap, const int *__restrict__ targets, float alpha, float lambda,           \
        float *lse_out, float *rest_out, float *loss_out, float *ent_out, int *am_out
#define FWD_ARGS                                                                              \
    L, ld, V, bias, softcap, targets, alpha, lambda, lse_out, rest_out, loss_out, ent_out, am_out

extern "C" __global__ void __launch_bounds__(FWD_THREADS) cce_dense_fwd_f32(FWD_PARAMS) {
    dense_fwd<0>(FWD_ARGS);
}
extern "C" __global__ void __launch_bounds__(FWD_THREADS) cce_dense_fwd_f16(FWD_PARAMS) {
    dense_fwd<1>(FWD_ARGS);
}
extern "C" __global__ void __launch_bounds__(FWD_THREADS) cce_dense_fwd_bf16(FWD_PARAMS) {
    dense_fwd<2>(FWD_ARGS);
}

// ------------------------------------------------------------------------------------------
// (2') Forward over class tiles (cce-core ClassForward: forward-only calls)
// ------------------------------------------------------------------------------------------
// Parameters:
//   L        f32 [rows, ldk] logits of one tile: rows r0.., classes c0..c0+K, row-major
//            (ldk a multiple of 8, 32-byte aligned rows);
//   bias     DT [V] (full; read at c0 + j) or 0;  targets i32 [rows] (class or −1), tile-relative;
//   state    f32 [rows, 6] running (m, s, t, zs, argmax bits, target logit) per row (s without
//            the target's term, RowAcc),
//            tile-relative; written by the first tile of a row group (`first`), merged into
//            by the others in class order;
//   lse, rest, loss, entropy, argmax: as cce_dense_fwd (tile-relative), written by the last tile
//            (`last`) only; entropy and argmax may be 0.
// Tiling: the logits of a forward-only call come in tiles of ClassForward's rows x classes;
//   this kernel reduces one tile's rows over its K classes and folds them into `state`, so
//   the lse of a row is the online log-sum-exp over its class tiles (the paper's section 4.1
//   blockwise lse). The host alternates two tile buffers: this kernel reads one (on a second
//   stream) while cuBLAS writes the next.
// Thread mapping: one warp per row (CLS_ROWS rows per block); lane l owns the float4 columns
//   4·l + 128·k of its row, CLS_UNROLL loads in flight; warp shuffles merge the lanes in a
//   fixed order and lane 0 merges the row state (bitwise deterministic).
#define CLS_THREADS 256
#define CLS_ROWS (CLS_THREADS / 32)
#define CLS_UNROLL 4

template <int DT, int UNROLL>
__device__ __forceinline__ void cls_fwd_row(const float* __restrict__ L, long long ldk, int K,
                                            int c0, int V, long long r,
                                            const void* __restrict__ bias, float softcap,
                                            const int* __restrict__ targets, float alpha,
                                            float lambda, float* __restrict__ state, int first,
                                            int last, float* lse_out, float* rest_out,
                                            float* loss_out, float* ent_out, int* am_out) {
    const int lane = threadIdx.x & 31;
    const int y = targets[r];
    const float* Lr = L + r * ldk;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const int K4 = K & ~3;
    RowAcc a;
    acc_init(a);
    for (int base = lane * 4; base < K4; base += 128 * UNROLL) {
        float4 xv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            int j = base + u * 128;
            xv[u] = j < K4 ? gemm_logit4(__ldg((const float4*)(Lr + j)))
                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        if (bias) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                int j = base + u * 128;
                if (j < K4) {
                    float4 b = Elem<DT>::load4(bias, c0 + j);
                    xv[u].x += b.x; xv[u].y += b.y; xv[u].z += b.z; xv[u].w += b.w;
                }
            }
        }
        if (softcap > 0.0f) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int k = 0; k < 4; ++k) f4set(xv[u], k, cap_z(f4get(xv[u], k), softcap, inv_cap));
        }
        acc_push_batch<UNROLL>(a, xv, c0 + base, 128, c0 + K4, y);
    }
    for (int j = K4 + lane; j < K; j += 32) {
        float x = gemm_logit(Lr[j]);
        if (bias) x += Elem<DT>::load(bias, c0 + j);
        acc_push(a, cap_z(x, softcap, inv_cap), c0 + j, y);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        RowAcc b = acc_shfl(a, o);
        acc_merge(a, b);
    }
    if (lane != 0) return;
    float* st = state + r * 6;
    float zy = first ? 0.0f : st[5];
    if (y >= c0 && y < c0 + K) {
        float x = Lr[y - c0];
        if (bias) x += Elem<DT>::load(bias, y);
        zy = cap_z(x, softcap, inv_cap);
    }
    if (!first) {
        // Earlier classes first: acc_merge keeps the lower argmax on ties.
        RowAcc p;
        p.m = st[0]; p.s = st[1]; p.t = st[2]; p.zs = st[3]; p.am = __float_as_int(st[4]);
        acc_merge(p, a);
        a = p;
    }
    if (!last) {
        st[0] = a.m; st[1] = a.s; st[2] = a.t; st[3] = a.zs; st[4] = __int_as_float(a.am);
        st[5] = zy;
        return;
    }
    write_row_outputs(r, y, a.m, a.s, zy, a.zs, a.t, a.am, alpha, lambda, V, lse_out, rest_out,
                      loss_out, ent_out, am_out);
}

#define CLS_PARAMS                                                                            \
    const float *__restrict__ L, long long ldk, int K, int c0, int V, int rows,               \
        const void *__restrict__ bias, float softcap, const int *__restrict__ targets,       \
        float alpha, float lambda, float *__restrict__ state, int first, int last,           \
        float *lse_out, float *rest_out, float *loss_out, float *ent_out, int *am_out

#define CLS_ROW_ARGS L, ldk, K, c0, V, r, bias, softcap, targets, alpha, lambda, state, first, \
    last, lse_out, rest_out, loss_out, ent_out, am_out
#define CLS_KERNELS(DTN, DT)                                                                  \
    extern "C" __global__ void __launch_bounds__(CLS_THREADS) cce_cls_fwd_##DTN(CLS_PARAMS) { \
        const long long r = (long long)blockIdx.x * CLS_ROWS + (threadIdx.x >> 5);            \
        if (r < rows) cls_fwd_row<DT, CLS_UNROLL>(CLS_ROW_ARGS);                              \
    }
CLS_KERNELS(f32, 0)
CLS_KERNELS(f16, 1)
CLS_KERNELS(bf16, 2)

