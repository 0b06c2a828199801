"""Can a paged kernel load its K/V pages with Hopper's tensor memory accelerator (TMA) from MLX?

    python bench/tma_probe.py [--out tma_probe.json]      # CUDA, sm_90 (H100, H200)

A TMA load reads a tile through a tensor map: 128 bytes the driver encodes on the host
(`cuTensorMapEncodeTiled`), holding the tensor's device address. MLX hands a kernel its arrays'
addresses on the device only, so the host encodes a template (`jit_kernels/tma.py`; the
device helpers, `jit_kernels/kernels/tma.cuh`, this probe shares with the prefill kernel) with
a placeholder address and each threadblock patches in the cache's (`tensormap.replace`,
sm_90a), publishes its copy to global memory with the proxy fence the TMA unit needs
(`tensormap.cp_fenceproxy`), and loads every page of its share through it, a box of (64
elements of D, one kv head, one page) per copy, into the 128-byte swizzled layout the wgmma
kernel reads (chunk c of row r at c ^ r % 8).

Checked: the pages gathered this way equal the cache's rows byte for byte, at block sizes 8,
16 and 32 and both halves of D = 128. Timed on the GPU alone: a gather of every page of one kv
head for 131072 keys (32 MiB read, 512 blocks of 16 pages), by TMA and by cp.async (the wgmma
kernel's own load), GB/s read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_time import gpu_us_together  # noqa: E402

from jit_kernels import hopper_paged_attention, nvrtc, sources, support, tma  # noqa: E402

HEAD_DIM, KV_HEADS = 128, 8
PAGES_PER_BLOCK = 16

# Grid: one threadblock of 128 threads per PAGES_PER_BLOCK pages (n_pages a multiple of it).
# In: tmap_tpl (uint8 [128], the encoded template), k_cache (bf16 [rows, KV_HEADS, HEAD_DIM]),
# table (int32 [n_pages]); out: pages (bf16 [n_pages * BS, HEAD_DIM]) of kv head `head`,
# tmaps (uint8 [blocks * 128], each block's patched map). BS, TMA (1: tensor map, 0: cp.async)
# are compile-time.
SOURCE = sources.fragments("nvrtc.cuh", "tma.cuh") + r"""
extern "C" __global__ void __launch_bounds__(128) NAME(
    const unsigned char* tmap_tpl, const unsigned short* k_cache, const int* table,
    unsigned short* pages, unsigned char* tmaps, int head) {
  constexpr int ROW_BYTES = 128, BOX_BYTES = BS * ROW_BYTES;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // 128-byte swizzle: boxes start on 1024-byte boundaries (the launch adds the slack)
  unsigned char* tile = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  __shared__ __align__(128) unsigned char tmap[1][128];
  __shared__ __align__(8) uint64_t full;
  const int tid = threadIdx.x;
  const int first = blockIdx.x * PAGES;
  unsigned char* my_map = tmaps + static_cast<size_t>(blockIdx.x) * 128;
  if (TMA) {
    if (tid < 32) {
      const void* const base[1] = {k_cache};
      publish_maps<1>(tid, tmap_tpl, base, tmap, my_map);
    }
    if (tid == 0) {
      acquire_maps<1>(my_map);
      mbar_init(smem_addr(&full), 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (tid == 0) {
      mbar_expect(smem_addr(&full), PAGES * 2 * BOX_BYTES);
      for (int p = 0; p < PAGES; ++p)
        for (int half = 0; half < 2; ++half)
          tma_load(smem_addr(tile + (2 * p + half) * BOX_BYTES), my_map, half * 64, head,
                   table[first + p] * BS, smem_addr(&full));
    }
    mbar_wait(smem_addr(&full), 0);
  } else {
    // the wgmma kernel's way: every thread resolves the page of each 16-byte chunk it copies
    for (int i = tid; i < PAGES * BS * 16; i += 128) {
      const int p = i / (BS * 16), r = (i / 16) % BS, c16 = i % 16, half = c16 / 8, c = c16 % 8;
      const unsigned short* src = k_cache + (static_cast<size_t>(table[first + p]) * BS + r) *
                                  (KV_HEADS * 128) + head * 128 + c16 * 8;
      const uint32_t dst = smem_addr(tile + (2 * p + half) * BOX_BYTES + r * ROW_BYTES +
                                     ((c ^ (r % 8)) * 16));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
  }
  // un-swizzle into rows of `pages`: chunk c of row r sits at c ^ (r % 8)
  for (int i = tid; i < PAGES * BS * 16; i += 128) {
    const int p = i / (BS * 16), r = (i / 16) % BS, c16 = i % 16, half = c16 / 8, c = c16 % 8;
    const uint4 v = *reinterpret_cast<const uint4*>(
        tile + (2 * p + half) * BOX_BYTES + r * ROW_BYTES + ((c ^ (r % 8)) * 16));
    *reinterpret_cast<uint4*>(pages + (static_cast<size_t>(first + p) * BS + r) * 128 +
                              c16 * 8) = v;
  }
}
"""


_kernels: dict = {}


def gather_pages(k_cache: mx.array, table: mx.array, template: mx.array, head: int,
                 block_size: int, by_tma: bool) -> mx.array:
    key = (block_size, by_tma)
    if key not in _kernels:
        tag = support.source_hash(SOURCE, str(key))
        name = f"tma_probe_{tag}_b{block_size}_{int(by_tma)}"
        source = (f"constexpr int BS = {block_size}, PAGES = {PAGES_PER_BLOCK}, "
                  f"KV_HEADS = {KV_HEADS}, TMA = {int(by_tma)};\n" + SOURCE.replace("NAME", name))
        _kernels[key] = name, nvrtc.compile_cubin(source, name, "sm_90a")
    name, cubin = _kernels[key]
    n_pages = table.shape[0]
    blocks = n_pages // PAGES_PER_BLOCK
    return mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=cubin, inputs=[template, k_cache, table],
        output_shapes=[(n_pages * block_size, HEAD_DIM), (blocks * 128,)],
        output_dtypes=[mx.bfloat16, mx.uint8], scalars=[head], grid=(blocks * 128, 1, 1),
        threadgroup=(128, 1, 1), shared_memory=PAGES_PER_BLOCK * 2 * block_size * 128 + 1024,
        ensure_row_contiguous=True)[0]


def case(block_size: int, n_pages: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    num_blocks = n_pages + 7
    k = mx.random.normal((num_blocks * block_size, KV_HEADS, HEAD_DIM),
                         key=mx.random.key(seed)).astype(mx.bfloat16)
    table = rng.permutation(num_blocks)[:n_pages].astype(np.int32)
    template = mx.array(tma.k_map(num_blocks * block_size, block_size, KV_HEADS))
    mx.eval(k, template)
    return k, mx.array(table), table, template


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    why = hopper_paged_attention.unavailable_reason()
    if why:
        raise SystemExit(f"needs a Hopper GPU: {why}")
    report = {"checks": [], "timing": []}
    for bs in (8, 16, 32):
        k, table, table_host, template = case(bs, 4 * PAGES_PER_BLOCK, seed=bs)
        rows = np.array(k.view(mx.uint16)).reshape(-1, bs, KV_HEADS, HEAD_DIM)
        for head in (0, KV_HEADS - 1):
            want = rows[table_host, :, head].reshape(-1, HEAD_DIM)
            for by_tma in (True, False):
                got = np.array(gather_pages(k, table, template, head, bs, by_tma).view(mx.uint16))
                ok = bool(np.array_equal(got, want))
                report["checks"].append({"block_size": bs, "head": head, "tma": by_tma, "exact": ok})
                print(f"block {bs:2d} head {head} {'tma     ' if by_tma else 'cp.async'} "
                      f"{'exact' if ok else 'DIFFERS'}", flush=True)
    bs, keys = 16, 131072
    k, table, _, template = case(bs, keys // bs)
    read = keys * HEAD_DIM * 2
    for by_tma in (True, False):
        us = gpu_us_together([lambda by_tma=by_tma: gather_pages(k, table, template, 0, bs, by_tma)] * 20)
        report["timing"].append({"keys": keys, "tma": by_tma, "us": us,
                                 "gbps_read": read / us / 1e3})
        print(f"{keys} keys of one kv head, {'tma' if by_tma else 'cp.async'}: {us:.2f} us a call, "
              f"{read / us / 1e3:.0f} GB/s read", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if not all(c["exact"] for c in report["checks"]):
        raise SystemExit("a TMA or cp.async gather differs from the cache")


if __name__ == "__main__":
    main()
