// What the Metal paged-attention kernels share (paged_attention.metal, split_merge.metal).
#include <metal_simdgroup>
#include <metal_simdgroup_matrix>
#define PP_UNROLL _Pragma("clang loop unroll(full)")
constant constexpr float NEG_INF = -metal::numeric_limits<float>::infinity();

// Element offset of key `key`'s row for one kv head in a [num_blocks, BS, Hkv, D] cache, in
// 64 bits (page offsets pass 2**31 in big caches); -1 past the item's keys (zero-filled).
// `table` is a device or constant pointer: MLX passes arrays under 8 elements as constant.
template <int BS, typename Table>
inline long pp_row_offset(Table table, int key, int kv_end, long row_stride, long head_off) {
  if (key >= kv_end) return -1;
  return (long(table[key / BS]) * BS + key % BS) * row_stride + head_off;
}
