// forward.cu: forward pass of cut cross-entropy (online log-sum-exp over class tiles).
//
// Parameters
//   e [N, D], c [V, D], bias [V] (nullable): input dtype (f32 / f16 / bf16 as u16 bits).
//   classes [N] i32: prepared targets (shift and ignore_index applied; -1 = ignored row).
//   softcap: s > 0 applies z = s·tanh(x/s); 0 = off. vec_ok: D % 8 == 0 (16-bit) or D % 4 == 0
//   (f32) and e, c are 16-byte aligned, so staging uses 16-byte loads.
//   part [6][n_splits][N] f32 (out): per class split and row: running max m, Σ e^(z−m),
//   Σ e^(z−m)(z−m), Σ z, argmax value, argmax index (int bits).
//   z_target [N] f32 (out): the target's logit z_{i,y_i}, written by the one thread that sees it
//   (rows whose class is -1 are not written).
//
// Tiling
//   grid = (row tiles of 128, class splits); block (bx, by) owns rows bx*128 .. +128 and the
//   class tiles [by*tiles_per_split, (by+1)*tiles_per_split) and walks them in order, keeping an
//   online (max, sum) per row (paper section 4.2). Partials of the splits are merged in a fixed
//   order by cce_forward_finalize, so the result is bitwise repeatable (no float atomics).
//
// Thread mapping
//   See common.cuh: each thread keeps the state of its 8 rows over its 8 classes per tile; the
//   4 lanes of a quad are merged with shuffles, the 4 warps of a row half through shared memory.

template <class Dt>
__device__ __forceinline__ void forward_impl(const typename Dt::T* __restrict__ e, const typename Dt::T* __restrict__ c,
                                             const typename Dt::T* __restrict__ bias, const int* __restrict__ classes,
                                             int N, int V, int D, int vec_ok, float softcap, int tiles_per_split,
                                             float* __restrict__ part, float* __restrict__ z_target) {
    extern __shared__ __align__(16) u8 smem[];
    const Lane L;
    const int row0 = blockIdx.x * TILE_M;
    const int rows_valid = min(TILE_M, N - row0);
    const int split = blockIdx.y, n_splits = gridDim.y;
    const int n_ctiles = (V + TILE_N - 1) / TILE_N;
    const int t_begin = split * tiles_per_split;
    const int t_end = min(n_ctiles, t_begin + tiles_per_split);

    float m[8], s[8], sp[8], sz[8], av[8];
    int ai[8], y[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        m[i] = neg_inf();
        s[i] = 0.f;
        sp[i] = 0.f;
        sz[i] = 0.f;
        av[i] = neg_inf();
        ai[i] = 0x7fffffff;
        int r = L.row_of(i);
        y[i] = r < rows_valid ? classes[row0 + r] : -1;
    }

    for (int tile = t_begin; tile < t_end; ++tile) {
        const int col0 = tile * TILE_N;
        const int cols_valid = min(TILE_N, V - col0);
        float acc[8][8];
        logits_tile<Dt>(e, row0, rows_valid, c, col0, cols_valid, D, vec_ok != 0, smem, acc, L);
        float bj[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            int cl = L.col_of(j);
            bj[j] = (bias != nullptr && cl < cols_valid) ? Dt::to_f(bias[col0 + cl]) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float z[8];
            float zmax = neg_inf();
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                int cl = L.col_of(j);
                float zz = apply_softcap(acc[i][j] + bj[j], softcap);
                z[j] = zz;
                if (cl < cols_valid) {
                    zmax = fmaxf(zmax, zz);
                    sz[i] += zz;
                    if (col0 + cl == y[i]) z_target[row0 + L.row_of(i)] = zz;
                    if (zz > av[i]) {
                        av[i] = zz;
                        ai[i] = col0 + cl;
                    }
                }
            }
            float mnew = fmaxf(m[i], zmax);
            if (mnew == neg_inf()) continue;
            if (mnew != m[i]) {
                // Rescale the running sums to the new max: Σ e^(z−m')(z−m') = f·(sp + (m−m')s).
                float f = (m[i] == neg_inf()) ? 0.f : expf(m[i] - mnew);
                sp[i] = (m[i] == neg_inf()) ? 0.f : f * (sp[i] + (m[i] - mnew) * s[i]);
                s[i] *= f;
                m[i] = mnew;
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (L.col_of(j) < cols_valid) {
                    float d = z[j] - mnew;
                    float p = expf(d);
                    s[i] += p;
                    sp[i] += p * d;
                }
            }
        }
    }

    // Merge the quad (t = 0..3) with shuffles, in a fixed pattern.
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            float m2 = __shfl_xor_sync(0xffffffffu, m[i], off);
            float s2 = __shfl_xor_sync(0xffffffffu, s[i], off);
            float sp2 = __shfl_xor_sync(0xffffffffu, sp[i], off);
            float sz2 = __shfl_xor_sync(0xffffffffu, sz[i], off);
            float av2 = __shfl_xor_sync(0xffffffffu, av[i], off);
            int ai2 = __shfl_xor_sync(0xffffffffu, ai[i], off);
            // Both lanes compute the same merged value: order the operands by lane so it is exact.
            if ((L.lane & off) == 0) {
                lse_merge(m[i], s[i], sp[i], m2, s2, sp2);
                sz[i] = sz[i] + sz2;
            } else {
                float mm = m2, ss = s2, pp = sp2;
                lse_merge(mm, ss, pp, m[i], s[i], sp[i]);
                m[i] = mm;
                s[i] = ss;
                sp[i] = pp;
                sz[i] = sz2 + sz[i];
            }
            argmax_merge(av[i], ai[i], av2, ai2);
        }
    }
    // Cross-warp merge through shared memory: red[wn][row][6].
    float* red = (float*)smem;
    if (L.t == 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float* q = red + (L.wn * TILE_M + L.row_of(i)) * 6;
            q[0] = m[i];
            q[1] = s[i];
            q[2] = sp[i];
            q[3] = sz[i];
            q[4] = av[i];
            q[5] = __int_as_float(ai[i]);
        }
    }
    __syncthreads();
    if (threadIdx.x < TILE_M && (int)threadIdx.x < rows_valid) {
        const int r = threadIdx.x;
        float M = neg_inf(), S = 0.f, SP = 0.f, SZ = 0.f, AV = neg_inf();
        int AI = 0x7fffffff;
        for (int w = 0; w < 4; ++w) {
            const float* q = red + (w * TILE_M + r) * 6;
            lse_merge(M, S, SP, q[0], q[1], q[2]);
            SZ += q[3];
            argmax_merge(AV, AI, q[4], __float_as_int(q[5]));
        }
        const i64 plane = (i64)n_splits * N;
        const i64 o = (i64)split * N + row0 + r;
        part[o] = M;
        part[plane + o] = S;
        part[2 * plane + o] = SP;
        part[3 * plane + o] = SZ;
        part[4 * plane + o] = AV;
        part[5 * plane + o] = __int_as_float(AI);
    }
}

#define CCE_FORWARD(NAME, DT)                                                                        \
    extern "C" __global__ void __launch_bounds__(NTHREADS) NAME(                                     \
        const DT::T* __restrict__ e, const DT::T* __restrict__ c, const DT::T* __restrict__ bias,    \
        const int* __restrict__ classes, int N, int V, int D, int vec_ok, float softcap,             \
        int tiles_per_split, float* __restrict__ part, float* __restrict__ z_target) {               \
        forward_impl<DT>(e, c, bias, classes, N, V, D, vec_ok, softcap, tiles_per_split, part, z_target); \
    }

CCE_FORWARD(cce_forward_f32, DtF32)
CCE_FORWARD(cce_forward_f16, DtF16)
CCE_FORWARD(cce_forward_bf16, DtBF16)

// One thread per row: merge the split partials in split order; write lse, the per-row loss
// (MATH.md: lse − (1−α) z_y − (α/V) Σ z + λ lse², 0 for ignored rows), entropy and argmax.
// part as written by cce_forward_*; z_target [N]; lse, loss_rows [N] f32 (out); entropy [N] f32
// and argmax [N] i32 (out, nullable).
extern "C" __global__ void cce_forward_finalize(const float* __restrict__ part, int n_splits, int N, int V,
                                                const int* __restrict__ classes, const float* __restrict__ z_target,
                                                float alpha, float lambda, float* __restrict__ lse,
                                                float* __restrict__ loss_rows, float* __restrict__ entropy,
                                                int* __restrict__ argmax) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    const i64 plane = (i64)n_splits * N;
    float M = neg_inf(), S = 0.f, SP = 0.f, SZ = 0.f, AV = neg_inf();
    int AI = 0x7fffffff;
    for (int k = 0; k < n_splits; ++k) {
        const i64 o = (i64)k * N + i;
        lse_merge(M, S, SP, part[o], part[plane + o], part[2 * plane + o]);
        SZ += part[3 * plane + o];
        argmax_merge(AV, AI, part[4 * plane + o], __float_as_int(part[5 * plane + o]));
    }
    const float logS = logf(S);
    const float l = M + logS;
    lse[i] = l;
    if (entropy) entropy[i] = logS - SP / S;
    if (argmax) argmax[i] = AI == 0x7fffffff ? 0 : AI;
    const int y = classes[i];
    float li = 0.f;
    if (y >= 0) li = l - (1.f - alpha) * z_target[i] - (alpha / (float)V) * SZ + lambda * l * l;
    loss_rows[i] = li;
}
