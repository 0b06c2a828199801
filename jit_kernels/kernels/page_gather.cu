// Page gather on CUDA: the body of an `mx.fast.cuda_kernel` (page_gather.inc has the contract).
#define PAGE_INDEX blockIdx.x
#define THREAD_INDEX int(threadIdx.x)
#define DEVICE
#define VEC_T uint4
#include "page_gather.inc"
