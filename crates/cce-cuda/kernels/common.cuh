// common.cuh: device code shared by every cut cross-entropy kernel (prepended to each .cu).
//
// Parameters
//   Matrices are row-major and contiguous: e [N, D], c [V, D], bias [V] in the input dtype
//   (f32, f16 or bf16; 16-bit types are carried as `unsigned short` and converted with bit
//   shifts / cvt PTX, so NVRTC needs no CUDA headers). Element offsets are 64-bit (`i64`);
//   row and class indices are 32-bit (N, V < 2^31 is checked on the host).
//
// Tiling
//   A logits tile is TILE_M x TILE_N = 128 rows x 128 classes, accumulated in f32 over D in
//   steps of BK = 32 (16-bit inputs) or 16 (f32). Each step stages a 128 x BK slice of e and of
//   c in shared memory (80-byte padded rows) through a 3-stage cp.async ring, so two steps of
//   loads are in flight while one is multiplied. The backward's second product (G·C or Gᵀ·E)
//   runs over D in slices of 128 columns with G (128 x 128) resident in shared memory and the
//   slices double-buffered with cp.async; the f32 accumulator rows of a slice are fetched into
//   registers before its product so their latency overlaps the tensor-core work.
//
// Thread mapping
//   256 threads = 8 warps as 2 (rows) x 4 (classes); warp (wm, wn) owns the 64 x 32 sub-tile at
//   rows wm*64, classes wn*32. Lane = 4*g + t. Thread-owned entries form an 8 x 8 Cartesian
//   product: rows  row_of(i) = wm*64 + (i/2)*16 + (i%2)*8 + g   (i = 0..7)
//                  cols  col_of(j) = wn*32 + (j/2)*8 + 2t + (j%2)  (j = 0..7)
//   which is exactly the accumulator layout of mma.sync.m16n8k16 (acc[2mi+h][2ni+q]); the f32
//   path (SIMT FMA) uses the same mapping so every epilogue is shared. A row's 128 entries live
//   in the 4 lanes of a quad (t = 0..3) of the 4 warps with the same wm.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define TILE_M 128
#define TILE_N 128
#define NTHREADS 256
#define SROW_BYTES 80
#define STAGE_BYTES (TILE_M * SROW_BYTES)
#define N_STAGES 3
#define LOGITS_SMEM_BYTES (2 * N_STAGES * STAGE_BYTES)
#define N_BINS 65

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---------------------------------------------------------------------------------------------
// Element types
// ---------------------------------------------------------------------------------------------

struct DtF32 {
    typedef float T;
    static const int BK = 16;      // depth step of the logits tile
    static const int VEC = 4;      // elements per 16-byte chunk
    static const bool MMA = false; // SIMT FMA path
    static const bool SPLIT = false; // G kept as one tile (f32)
    static const int XS_STRIDE = 132; // elements per row of the 128-wide second-product tiles
    static __device__ __forceinline__ float to_f(float x) { return x; }
    static __device__ __forceinline__ float from_f(float x) { return x; }
};

struct DtBF16 {
    typedef u16 T;
    static const int BK = 32;
    static const int VEC = 8;
    static const bool MMA = true;
    static const bool SPLIT = true; // G = hi + lo, two bf16 tiles (16-bit mantissa)
    static const int XS_STRIDE = 136;
    static __device__ __forceinline__ float to_f(u16 x) { return __uint_as_float(((u32)x) << 16); }
    static __device__ __forceinline__ u16 from_f(float x) {
        u16 r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
        return r;
    }
    static __device__ __forceinline__ void mma(float& d0, float& d1, float& d2, float& d3,
                                               const u32* a, const u32* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

struct DtF16 {
    typedef u16 T;
    static const int BK = 32;
    static const int VEC = 8;
    static const bool MMA = true;
    static const bool SPLIT = true; // G = hi + lo, two f16 tiles (22-bit mantissa)
    static const int XS_STRIDE = 136;
    static __device__ __forceinline__ float to_f(u16 x) {
        float r;
        asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x));
        return r;
    }
    static __device__ __forceinline__ u16 from_f(float x) {
        u16 r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
        return r;
    }
    static __device__ __forceinline__ void mma(float& d0, float& d1, float& d2, float& d3,
                                               const u32* a, const u32* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p))
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p))
                 : "memory");
}

// 16-byte global -> shared copy that bypasses registers (sm_80+), and its group fences.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gsrc) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem_dst)), "l"(gsrc) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Stage one 16-byte chunk (VEC elements) of row `r` at column k of src [*, D] into smem `dst`:
// cp.async when the chunk is whole and aligned, else element loads (zeros past D / rows_valid).
template <class Dt>
__device__ __forceinline__ void stage_chunk(u8* dst, const typename Dt::T* __restrict__ src, int row, bool row_ok,
                                            int k, int D, bool vec_ok) {
    typedef typename Dt::T T;
    if (row_ok && k < D) {
        const T* p = src + (i64)row * D + k;
        if (vec_ok && k + Dt::VEC <= D) {
            cp_async16(dst, p);
            return;
        }
        union {
            uint4 v;
            T e[Dt::VEC];
        } val;
        val.v = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int x = 0; x < Dt::VEC; ++x)
            if (k + x < D) val.e[x] = p[x];
        *(uint4*)dst = val.v;
    } else {
        *(uint4*)dst = make_uint4(0u, 0u, 0u, 0u);
    }
}

// Stage the 128 x BK slices of e (rows row0..) and c (rows col0..) at depth k0 into `stage`.
template <class Dt>
__device__ __forceinline__ void stage_step(u8* stage, const typename Dt::T* __restrict__ e, int row0, int rows_valid,
                                           const typename Dt::T* __restrict__ c, int col0, int cols_valid, int k0,
                                           int D, bool vec_ok) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        int ch = threadIdx.x + u * NTHREADS;
        int r = ch >> 2, q = ch & 3;
        int k = k0 + q * Dt::VEC;
        stage_chunk<Dt>(stage + r * SROW_BYTES + q * 16, e, row0 + r, r < rows_valid, k, D, vec_ok);
        stage_chunk<Dt>(stage + STAGE_BYTES + r * SROW_BYTES + q * 16, c, col0 + r, r < cols_valid, k, D, vec_ok);
    }
}

struct Lane {
    int lane, wm, wn, g, t;
    __device__ __forceinline__ Lane() {
        lane = threadIdx.x & 31;
        int warp = threadIdx.x >> 5;
        wm = warp >> 2;
        wn = warp & 3;
        g = lane >> 2;
        t = lane & 3;
    }
    __device__ __forceinline__ int row_of(int i) const { return wm * 64 + (i >> 1) * 16 + (i & 1) * 8 + g; }
    __device__ __forceinline__ int col_of(int j) const { return wn * 32 + (j >> 1) * 8 + 2 * t + (j & 1); }
};

// Softcap z = s * tanh(x / s); s <= 0 means off.
// Only finite logits are capped (an f32 overflow stays infinite and reaches the lse check).
__device__ __forceinline__ float apply_softcap(float x, float s) { return s > 0.f && isfinite(x) ? s * tanhf(x / s) : x; }

// Fixed-point mass of the filter histogram: ceil(g0 * 2^30) (cce_core::FilterRule::mass_to_fixed).
__device__ __forceinline__ u32 mass_to_fixed(float g0) {
    float f = ceilf(g0 * 1073741824.0f);
    return f >= 4294967295.0f ? 0xffffffffu : (u32)f;
}

// Histogram bin of 0 <= g0 < eps against the host's edge table (edge[k] = eps * 2^(-k/4)):
// bin k holds [edge[k+1], edge[k]), the last bin [0, edge[N_BINS-1]). Same result as
// cce_core::FilterRule::bin for any start guess, because the guards only use the table.
__device__ __forceinline__ int filter_bin(float g0, float eps, const float* edges) {
    if (g0 <= 0.f) return N_BINS - 1;
    float kf = floorf(-4.0f * log2f(g0 / eps));
    int k = kf < 0.f ? 0 : (kf > (float)(N_BINS - 1) ? N_BINS - 1 : (int)kf);
    while (k > 0 && g0 >= edges[k]) --k;
    while (k < N_BINS - 1 && g0 < edges[k + 1]) ++k;
    return k;
}

// One BK step of the logits tile: acc += As · Bsᵀ over the staged slices.
template <class Dt>
__device__ __forceinline__ void tile_step(const u8* As, const u8* Bs, float (&acc)[8][8], const Lane& L) {
    if constexpr (Dt::MMA) {
#pragma unroll
        for (int kk = 0; kk < Dt::BK; kk += 16) {
            u32 a[4][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                int r = L.wm * 64 + mi * 16 + (L.lane & 7) + ((L.lane >> 3) & 1) * 8;
                int k = kk + (L.lane >> 4) * 8;
                ldsm_x4(a[mi][0], a[mi][1], a[mi][2], a[mi][3], As + r * SROW_BYTES + k * 2);
            }
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                int n = L.wn * 32 + p * 16 + (L.lane & 7) + (L.lane >> 4) * 8;
                int k = kk + ((L.lane >> 3) & 1) * 8;
                ldsm_x4(b[2 * p][0], b[2 * p][1], b[2 * p + 1][0], b[2 * p + 1][1], Bs + n * SROW_BYTES + k * 2);
            }
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni)
                    Dt::mma(acc[2 * mi][2 * ni], acc[2 * mi][2 * ni + 1], acc[2 * mi + 1][2 * ni],
                            acc[2 * mi + 1][2 * ni + 1], a[mi], b[ni]);
        }
    } else {
        const float* Af = (const float*)As;
        const float* Bf = (const float*)Bs;
        const int stride = SROW_BYTES / 4;
#pragma unroll
        for (int k = 0; k < Dt::BK; ++k) {
            float a[8], b[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) a[i] = Af[L.row_of(i) * stride + k];
#pragma unroll
            for (int j = 0; j < 8; ++j) b[j] = Bf[L.col_of(j) * stride + k];
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
    }
}

// The logits tile x = e[row0 .. +128] · c[col0 .. +128]ᵀ in f32 (no bias, no softcap), in the
// thread's 8 x 8 fragment. Out-of-range rows / classes give 0. Uses LOGITS_SMEM_BYTES of smem;
// every thread must call it; it starts writing smem at once (the caller's previous readers
// must have passed a barrier) and ends with __syncthreads() so smem may be reused after it.
template <class Dt>
__device__ __forceinline__ void logits_tile(const typename Dt::T* __restrict__ e, int row0, int rows_valid,
                                            const typename Dt::T* __restrict__ c, int col0, int cols_valid,
                                            int D, bool vec_ok, u8* smem, float (&acc)[8][8], const Lane& L) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
    const int nk = (D + Dt::BK - 1) / Dt::BK;
#pragma unroll
    for (int s = 0; s < N_STAGES - 1; ++s) {
        if (s < nk) stage_step<Dt>(smem + s * 2 * STAGE_BYTES, e, row0, rows_valid, c, col0, cols_valid, s * Dt::BK, D, vec_ok);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<N_STAGES - 2>();
        __syncthreads();
        // The stage refilled here was read at step kt-1; every thread is past the barrier.
        const int nxt = kt + N_STAGES - 1;
        if (nxt < nk)
            stage_step<Dt>(smem + (nxt % N_STAGES) * 2 * STAGE_BYTES, e, row0, rows_valid, c, col0, cols_valid,
                           nxt * Dt::BK, D, vec_ok);
        cp_async_commit();
        const u8* As = smem + (kt % N_STAGES) * 2 * STAGE_BYTES;
        tile_step<Dt>(As, As + STAGE_BYTES, acc, L);
    }
    cp_async_wait<0>();
    __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// Second product of the backward: out[128, D] += A[128, 128] · src[src_row0 .. +128, :]
// ---------------------------------------------------------------------------------------------

// Shared bytes of one 128 x 128 operand tile of the second product (A or a B slice).
template <class Dt>
__host__ __device__ constexpr int xs_bytes() {
    return TILE_M * Dt::XS_STRIDE * (int)sizeof(typename Dt::T);
}

// Shared bytes of the G operand: one tile, or hi and lo tiles when Dt::SPLIT.
template <class Dt>
__host__ __device__ constexpr int g_bytes() {
    return Dt::SPLIT ? 2 * xs_bytes<Dt>() : xs_bytes<Dt>();
}

// Shared bytes of the region that holds either the logits stages or the two B slices.
template <class Dt>
__host__ __device__ constexpr int x_region_bytes() {
    return 2 * xs_bytes<Dt>() > LOGITS_SMEM_BYTES ? 2 * xs_bytes<Dt>() : LOGITS_SMEM_BYTES;
}

// A (`As`, XS_STRIDE-padded rows, k contiguous) is resident in smem. For each slice of 128
// columns of D: stage src rows (k) x columns (n) in one of the two `Xs` buffers (2 x xs_bytes,
// the next slice's copy in flight during this slice's product), multiply, and read-modify-write
// the f32 accumulator `accg` (row r of the output at accg + r*D; rows >= out_rows_valid are not
// written). The calling block owns those accumulator rows: no other block touches them during
// the launch. The caller's writes of `As` must precede the call; Xs must be free (past a
// barrier). Ends with __syncthreads().
template <class Dt>
__device__ __forceinline__ void stage_slice(u8* Xs, const typename Dt::T* __restrict__ src, int src_row0,
                                            int src_rows_valid, int d0, int D, bool vec_ok) {
    const int CPR = 128 / Dt::VEC;                 // chunks per staged row
    const int PER_THREAD = (128 * CPR) / NTHREADS; // chunks per thread
    const int XS_ROW_BYTES = Dt::XS_STRIDE * (int)sizeof(typename Dt::T);
#pragma unroll
    for (int u = 0; u < PER_THREAD; ++u) {
        int ch = threadIdx.x + u * NTHREADS;
        int r = ch / CPR, q = ch % CPR;
        stage_chunk<Dt>(Xs + r * XS_ROW_BYTES + q * 16, src, src_row0 + r, r < src_rows_valid, d0 + q * Dt::VEC, D,
                        vec_ok);
    }
}

template <class Dt>
__device__ __forceinline__ void second_product(const u8* As, u8* Xs, const typename Dt::T* __restrict__ src,
                                               int src_row0, int src_rows_valid, int D, bool vec_ok,
                                               float* __restrict__ accg, int out_rows_valid, const Lane& L) {
    typedef typename Dt::T T;
    const int XS_ROW_BYTES = Dt::XS_STRIDE * (int)sizeof(T);
    const int nd = (D + 127) / 128;
    const bool pairs = (D & 1) == 0;
    stage_slice<Dt>(Xs, src, src_row0, src_rows_valid, 0, D, vec_ok);
    cp_async_commit();
    for (int s = 0; s < nd; ++s) {
        const int d0 = s * 128;
        if (s + 1 < nd) stage_slice<Dt>(Xs + ((s + 1) & 1) * xs_bytes<Dt>(), src, src_row0, src_rows_valid, d0 + 128, D, vec_ok);
        cp_async_commit();
        // Fetch this slice's accumulator values now; they are added after the product.
        float old[8][8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            int r = L.row_of(i);
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                int col = d0 + L.col_of(j);
                old[i][j] = 0.f;
                old[i][j + 1] = 0.f;
                if (r < out_rows_valid && col < D) {
                    const float* rowp = accg + (i64)r * D;
                    if (pairs) {
                        float2 v = *(const float2*)(rowp + col);
                        old[i][j] = v.x;
                        old[i][j + 1] = v.y;
                    } else {
                        old[i][j] = rowp[col];
                        if (col + 1 < D) old[i][j + 1] = rowp[col + 1];
                    }
                }
            }
        }
        cp_async_wait<1>();
        __syncthreads();
        const u8* Xc = Xs + (s & 1) * xs_bytes<Dt>();
        float acc[8][8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
        if constexpr (Dt::MMA) {
#pragma unroll 2
            for (int kk = 0; kk < 128; kk += 16) {
                u32 b[4][2];
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    // Xs is [k][n]: .trans gives the col-major B fragment directly.
                    int k = kk + (L.lane & 7) + ((L.lane >> 3) & 1) * 8;
                    int n = L.wn * 32 + p * 16 + (L.lane >> 4) * 8;
                    ldsm_x4_trans(b[2 * p][0], b[2 * p][1], b[2 * p + 1][0], b[2 * p + 1][1],
                                  Xc + k * XS_ROW_BYTES + n * 2);
                }
#pragma unroll
                for (int part = 0; part < (Dt::SPLIT ? 2 : 1); ++part) {
                    const u8* Ap = As + part * xs_bytes<Dt>();
#pragma unroll
                    for (int mi = 0; mi < 4; ++mi) {
                        u32 a[4];
                        int r = L.wm * 64 + mi * 16 + (L.lane & 7) + ((L.lane >> 3) & 1) * 8;
                        int k = kk + (L.lane >> 4) * 8;
                        ldsm_x4(a[0], a[1], a[2], a[3], Ap + r * XS_ROW_BYTES + k * 2);
#pragma unroll
                        for (int ni = 0; ni < 4; ++ni)
                            Dt::mma(acc[2 * mi][2 * ni], acc[2 * mi][2 * ni + 1], acc[2 * mi + 1][2 * ni],
                                    acc[2 * mi + 1][2 * ni + 1], a, b[ni]);
                    }
                }
            }
        } else {
            const float* Af = (const float*)As;
            const float* Xf = (const float*)Xc;
#pragma unroll 4
            for (int k = 0; k < 128; ++k) {
                float a[8], b[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) a[i] = Af[L.row_of(i) * Dt::XS_STRIDE + k];
#pragma unroll
                for (int j = 0; j < 8; ++j) b[j] = Xf[k * Dt::XS_STRIDE + L.col_of(j)];
#pragma unroll
                for (int i = 0; i < 8; ++i)
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            int r = L.row_of(i);
            if (r >= out_rows_valid) continue;
            float* rowp = accg + (i64)r * D;
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                int col = d0 + L.col_of(j);
                if (col >= D) continue;
                if (pairs) {
                    *(float2*)(rowp + col) = make_float2(old[i][j] + acc[i][j], old[i][j + 1] + acc[i][j + 1]);
                } else {
                    rowp[col] = old[i][j] + acc[i][j];
                    if (col + 1 < D) rowp[col + 1] = old[i][j + 1] + acc[i][j + 1];
                }
            }
        }
        // Every thread is done with Xs[s & 1] before iteration s + 1 refills it.
        __syncthreads();
    }
    cp_async_wait<0>();
}

// Write a value of G into a 128 x 128 smem operand tile at (r, k) (XS_STRIDE-padded rows).
// With Dt::SPLIT the value is stored as hi = round(v) in the first tile and lo = round(v − hi)
// in the second (xs_bytes further), so hi + lo carries ~16 mantissa bits.
template <class Dt>
__device__ __forceinline__ void put_g(u8* Gs, int r, int k, float v) {
    typedef typename Dt::T T;
    T hi = Dt::from_f(v);
    ((T*)Gs)[r * Dt::XS_STRIDE + k] = hi;
    if constexpr (Dt::SPLIT) ((T*)(Gs + xs_bytes<Dt>()))[r * Dt::XS_STRIDE + k] = Dt::from_f(v - Dt::to_f(hi));
}

// Merge two online log-sum-exp states (max m, Σ e^(z-m), Σ e^(z-m)(z-m)).
__device__ __forceinline__ void lse_merge(float& m, float& s, float& sp, float m2, float s2, float sp2) {
    float M = fmaxf(m, m2);
    if (M == neg_inf()) return;
    float f1 = (m == neg_inf()) ? 0.f : expf(m - M);
    float f2 = (m2 == neg_inf()) ? 0.f : expf(m2 - M);
    float a1 = (m == neg_inf()) ? 0.f : f1 * (sp + (m - M) * s);
    float a2 = (m2 == neg_inf()) ? 0.f : f2 * (sp2 + (m2 - M) * s2);
    s = s * f1 + s2 * f2;
    sp = a1 + a2;
    m = M;
}

// Argmax merge: larger value wins, lower index on ties.
__device__ __forceinline__ void argmax_merge(float& v, int& idx, float v2, int idx2) {
    if (v2 > v || (v2 == v && idx2 < idx)) {
        v = v2;
        idx = idx2;
    }
}
