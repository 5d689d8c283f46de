// common.cuh: types shared by the backend's own kernels (prepended to util.cu).
//
// Parameters
//   Buffers are row-major and contiguous in their dtype (f32, f16 or bf16; 16-bit types are
//   carried as `unsigned short` and converted with cvt PTX, so NVRTC needs no CUDA headers).
//   Element offsets are 64-bit (`i64`).
//
// Tiling
//   None here: the element types only (the loss kernels live in the dense kernel files and wgmma.cu).
//
// Thread mapping
//   None here (see each kernel).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// Element types: storage type T and the rounding conversion from f32.
struct DtF32 {
    typedef float T;
    static __device__ __forceinline__ float from_f(float x) { return x; }
};

struct DtBF16 {
    typedef u16 T;
    static __device__ __forceinline__ u16 from_f(float x) {
        u16 r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
        return r;
    }
};

struct DtF16 {
    typedef u16 T;
    static __device__ __forceinline__ u16 from_f(float x) {
        u16 r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
        return r;
    }
};
