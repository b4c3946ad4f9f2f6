// Rotary position embedding, the pieces a kernel rotating a head in registers needs: which
// channel a channel turns with, the angles of a token (from per-token cos / sin rows or from a
// cos_sin_cache row of its position) and the rotation by +theta and by -theta (its transpose).
//
// Channel j < rotary_dim turns with its partner j ^ PAIRS; of a pair, the channel whose PAIRS
// bit is clear is the first:
//   first:  o[j] = y[j] cos[j] - y[partner] sin[j]
//   second: o[j] = y[j] cos[j] + y[partner] sin[j]
// PAIRS = 1: interleaved pairs (2i, 2i + 1), GPT-J's; PAIRS = h > 1 (a power of two): NeoX
// halves, j with j + h for j < h = rotary_dim / 2; PAIRS = 0: NeoX halves of any even
// rotary_dim (no XOR reaches the partner: the kernels exchange the values through shared
// memory). Products are rounded on their own (__fmul_rn), never fused into the add or
// subtract, so the result is the NumPy reference's float32 arithmetic exactly
// (cupy_rmsnorm/_reference.py).
#pragma once

#include "common.cuh"

namespace rmsnorm {

// The index of channel j's angle in a cos_sin_cache row (cos at m, sin at rotary_dim / 2 + m):
// both channels of a pair share it. `half` is rotary_dim / 2 (PAIRS = 0 reads it at run time).
template <int PAIRS>
__device__ __forceinline__ int angle_index(int j, int half) {
    if (PAIRS == 1) return j >> 1;
    if (PAIRS > 1) return j & (PAIRS - 1);
    return j < half ? j : j - half;
}

// The partner of channel j < rotary_dim, and whether j is its pair's first.
template <int PAIRS>
__device__ __forceinline__ int partner_of(int j, int half) {
    if (PAIRS > 0) return j ^ PAIRS;
    return j < half ? j + half : j - half;
}

template <int PAIRS>
__device__ __forceinline__ bool first_of_pair(int j, int half) {
    return PAIRS > 0 ? (j & PAIRS) == 0 : j < half;
}

// y rotated by +theta (the forward), and a gradient by -theta (the backward: the transpose,
// which takes the partner's sin): with a = v cos[j], b = partner's v times sin,
template <bool INVERSE>
__device__ __forceinline__ float rotate(float v, float partner, float c, float s, bool first) {
    const float a = __fmul_rn(v, c), b = __fmul_rn(partner, s);
    return first != INVERSE ? a - b : a + b;
}

// N floats from p: 16-byte loads where p is aligned to them, else one element at a time.
template <typename C, int N>
__device__ __forceinline__ void load_floats(const C* p, float (&f)[N]) {
    constexpr int K = N * sizeof(C) <= 16 ? N : 16 / sizeof(C);      // elements a load
#pragma unroll
    for (int c = 0; c < N; c += K) {
        if (reinterpret_cast<unsigned long long>(p + c) % (K * sizeof(C)) == 0) {
            const Pack<C, K> v = *reinterpret_cast<const Pack<C, K>*>(p + c);
#pragma unroll
            for (int e = 0; e < K; ++e) f[c + e] = to_float(v.v[e]);
        } else {
#pragma unroll
            for (int e = 0; e < K; ++e) f[c + e] = to_float(p[c + e]);
        }
    }
}

// One token's angles. Transformers' convention: rows of its own cos and sin (cos[j], sin[j]).
// vLLM's and FlashInfer's (CACHE): the cos_sin_cache row of the token's position, cos at
// angle_index(j), sin rotary_dim / 2 further. A position outside the cache (valid false) has
// NaN angles: its rotated channels come out NaN, and nothing outside the cache is read.
template <typename C, bool CACHE, int PAIRS>
struct TokenAngles {
    const C* cos_row;        // (CACHE: the position's cache row)
    const C* sin_row;        // (CACHE: that row's sin half)
    int half;                // rotary_dim / 2
    bool valid;

    __device__ __forceinline__ float cos_at(int j) const {
        return valid ? to_float(cos_row[CACHE ? angle_index<PAIRS>(j, half) : j]) : __int_as_float(0x7fffffff);
    }
    __device__ __forceinline__ float sin_at(int j) const {
        return valid ? to_float(sin_row[CACHE ? angle_index<PAIRS>(j, half) : j]) : __int_as_float(0x7fffffff);
    }

    // The angles of the VEC channels from j0 (a multiple of VEC, all below rotary_dim): the cos
    // of each, and the sin of each (PARTNER_SIN: of each one's partner, as the transpose
    // takes it), in vector loads where the channels' angles lie side by side.
    template <int VEC, bool PARTNER_SIN>
    __device__ __forceinline__ void vector(int j0, float (&c)[VEC], float (&s)[VEC]) const {
        static_assert(PAIRS > 0, "PAIRS = 0 takes its angles a channel at a time (cos_at, sin_at)");
        if (!valid) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) c[e] = s[e] = __int_as_float(0x7fffffff);
            return;
        }
        if (!CACHE) {                            // a row each: side by side
            load_floats<C, VEC>(cos_row + j0, c);
            if (!PARTNER_SIN || PAIRS < VEC) {
                load_floats<C, VEC>(sin_row + j0, s);
                if (PARTNER_SIN) {               // the partners share this vector
                    float own[VEC];
#pragma unroll
                    for (int e = 0; e < VEC; ++e) own[e] = s[e];
#pragma unroll
                    for (int e = 0; e < VEC; ++e) s[e] = own[e ^ PAIRS];
                }
            } else {
                load_floats<C, VEC>(sin_row + (j0 ^ PAIRS), s);
            }
        } else if (PAIRS > 1 && PAIRS >= VEC) {  // NeoX halves: the vector's angles side by side
            load_floats<C, VEC>(cos_row + (j0 & (PAIRS - 1)), c);
            load_floats<C, VEC>(sin_row + (j0 & (PAIRS - 1)), s);
        } else if (PAIRS == 1 && VEC >= 2) {      // interleaved: an angle for each pair
            constexpr int H = VEC >= 2 ? VEC / 2 : 1;
            float hc[H], hs[H];
            load_floats<C, H>(cos_row + j0 / 2, hc);
            load_floats<C, H>(sin_row + j0 / 2, hs);
#pragma unroll
            for (int e = 0; e < VEC; ++e) { c[e] = hc[e / 2]; s[e] = hs[e / 2]; }
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) { c[e] = cos_at(j0 + e); s[e] = sin_at(j0 + e); }
        }
    }
};

// The angles of one token: its cos and sin rows, or (CACHE) its position's cache row.
// positions are int32, or int64 with INT64; an index outside [0, max_position) is invalid.
template <typename C, bool CACHE, int PAIRS>
__device__ __forceinline__ TokenAngles<C, CACHE, PAIRS> token_angles(const C* cos, const C* sin, const void* positions,
                                                                     bool int64_positions, long long cos_offset,
                                                                     long long sin_offset, long long position_offset,
                                                                     long long cache_row, long long max_position,
                                                                     int rotary_dim) {
    TokenAngles<C, CACHE, PAIRS> a;
    a.half = rotary_dim / 2;
    if (CACHE) {
        const long long pos = int64_positions ? static_cast<const long long*>(positions)[position_offset]
                                              : (long long)static_cast<const int*>(positions)[position_offset];
        a.valid = pos >= 0 && pos < max_position;
        a.cos_row = cos + (a.valid ? pos : 0) * cache_row;
        a.sin_row = a.cos_row + a.half;
    } else {
        a.valid = true;
        a.cos_row = cos + cos_offset;
        a.sin_row = sin + sin_offset;
    }
    return a;
}

}  // namespace rmsnorm
