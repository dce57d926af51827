// KV-cache writes and block copies. Both move raw units U (2, 4 or 16 bytes), so one
// instantiation serves every element type whose row size is a multiple of U.
//
// write_kv: k, v [T, row] -> k_cache, v_cache [num_blocks * block_size, row] at
// slot_mapping[t] (flat slot = block * block_size + offset; negative = skip).
// copy_blocks: kv_cache [layers * 2, num_blocks, block_units] per (src[i], dst[i]).
#include "dtypes.h"

// grid (T), block 128; row_units = Hkv * D elements expressed in units of U.
template <typename U, typename IDX>
__global__ void __launch_bounds__(128)
    write_kv(U* k_cache, U* v_cache, const U* k, const U* v, const IDX* slot_mapping,
             int row_units) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const long long src = (long long)blockIdx.x * row_units;
  const long long dst = slot * row_units;
  for (int i = threadIdx.x; i < row_units; i += blockDim.x) {
    k_cache[dst + i] = k[src + i];
    v_cache[dst + i] = v[src + i];
  }
}

// grid (num_pairs, layers * 2), block 256; block_units = block_size * Hkv * D in units of U.
template <typename U, typename IDX>
__global__ void __launch_bounds__(256)
    copy_blocks(U* kv_cache, const IDX* src, const IDX* dst, long long num_blocks,
                int block_units) {
  const long long plane = (long long)blockIdx.y * num_blocks;
  U* to = kv_cache + (plane + dst[blockIdx.x]) * block_units;
  const U* from = kv_cache + (plane + src[blockIdx.x]) * block_units;
  for (int i = threadIdx.x; i < block_units; i += blockDim.x) to[i] = from[i];
}
