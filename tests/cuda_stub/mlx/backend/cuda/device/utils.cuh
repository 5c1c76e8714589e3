// A stand-in for what MLX's CUDA custom-kernel header provides (CUDA's device builtins and
// cuda_fp16 types), so g++ can syntax-check strata's CUDA kernels (tests/mlx_backend/test_metal_compile.py).
// Only what the kernels may use is declared: `uint` is deliberately absent (CUDA has none).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cmath>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__

struct dim3 { unsigned int x, y, z; };
extern dim3 threadIdx, blockIdx, blockDim, gridDim;
void __syncthreads();
void __syncwarp(unsigned int mask = 0xffffffffu);
void __threadfence();
void __nanosleep(unsigned int ns);
float __ldcg(const float* p);
unsigned int __float_as_uint(float x);
unsigned int atomicAdd(unsigned int* address, unsigned int val);
float __shfl_xor_sync(unsigned int mask, float v, int lane_mask);
float __shfl_sync(unsigned int mask, float v, int src);
unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s);
size_t __cvta_generic_to_shared(const void* p);

struct __half {  // no conversion operator: kernels must convert with __half2float
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
  operator float() const;
};
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint2 { uint32_t x, y; };
struct uint4 { uint32_t x, y, z, w; };
struct __half2 { __half x, y; };
float2 __half22float2(__half2);
float __half2float(__half);
__half __float2half_rn(float);
unsigned short __half_as_ushort(__half);
