// Page gather on Metal: the body of an `mx.fast.metal_kernel` (page_gather.inc has the
// contract).
#define PAGE_INDEX threadgroup_position_in_grid.x
#define THREAD_INDEX int(thread_index_in_threadgroup)
#define DEVICE device
#define VEC_T uint4
#include "page_gather.inc"
