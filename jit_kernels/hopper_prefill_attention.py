"""Long prefills over cached prefixes on Hopper: a warp-specialized kernel that loads K/V pages
with TMA (sm_90a, through NVRTC and `mx.fast.precompiled_cuda_kernel`).

    plan = kernel.plan(cu_seqlens_q, seq_lens, geometry, seqs)   # once per forward
    out = kernel(q, k_cache, v_cache, block_tables, plan)        # every layer

What the wgmma kernel (`hopper_paged_attention`) cannot: keep the tensor cores fed at long
suffixes. cuDNN's SDPA on contiguous K/V reaches ~1.6x its TFLOP/s there, so the dispatcher
sent those sequences to a page gather + SDPA, paying the gather. This kernel has cuDNN's
structure on paged K/V: on the H200 it took 0.71-1.01x the time of gather + SDPA wherever the
prefix holds four times the new tokens or more (256 to 2048 of them), and 0.99-1.17x the time
of cuDNN on K/V that are already contiguous (docs/gpu.md, rules.CUDA_PREFILL_MIN_CTX_PER_Q):

- a threadblock of three warpgroups, one work item: 128 query rows of one kv head (GQA rows
  packed as in `plan.py`), planned unsplit, all its keys;
- the producer's first warp loads each K/V tile of KV_TILE keys page by page with TMA
  (`tma.py`): a lane per K box (half a page), a lane per V box (a page), each lane holding
  its page's block id one tile ahead (read between a slot's release and its loads, the table
  cost the prototype 1.12x the time at C16384_Lq512). The tiles go into a ring of
  STAGES stages; a K slot and a V slot each have a "full" barrier and an "empty" one the
  consumers release, K's as soon as S is done;
- two consumer warpgroups of 64 rows issue S of tile t + 1 and O += P V of tile t together
  and run the softmax of t + 1 while P V runs (FlashAttention-3's intra-warpgroup overlap),
  with the wgmma kernel's source pieces; they zero the V rows past the range in the last tile
  (those rows hold other pages' data);
- `setmaxnreg` moves registers from the producer to the consumers.

Rows of sequences the plan leaves out are not written. Same contract as the reference; caches
as pages or as a `PagedKVCache` stores them (the kernel reads bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import cuda_paged_attention as cpa
from . import hopper_paged_attention as hp
from . import nvrtc, tma
from . import plan as tile_plan
from .arrays import check_call, device_array
from .geometry import Geometry, Lengths, dtype_name, unsupported_reason
from .interface import Plan, refuse_unsupported, write_rows
from .sources import source_hash

BLOCK_M = 128  # two consumer warpgroups of 64 rows
KV_TILE = 128  # keys a stage holds (64: 1.15x the time at C16384_Lq512, docs/gpu.md)
STAGES = 3  # V(t) stays while K(t + 1) and tile t + 2 land
THREADS = 384
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # 128 x 40 + 256 x 232 <= 64K registers
HEAD_DIMS = (128,)
SMEM_BYTES = 2 * STAGES * KV_TILE * 128 * 2 + 1024  # K and V per stage, + alignment slack

# The wgmma kernel's pieces at this tile width; V lands a page at a time as [2][BS][64], so a
# k-step's 16 keys start at their page's slot (BS >= 16) or span two (BS = 8: 8-row groups a
# page apart) and the two 64-column halves of a page are BS rows apart.
ONLINE_SOFTMAX = cpa.ONLINE_SOFTMAX.replace("BLOCK_N", "KV_TILE")
P_FROM_S = hp.P_FROM_S.replace("BLOCK_N", "KV_TILE")
S_ISSUE = hp.s_issue(KV_TILE)
PV_ISSUE = hp.pv_issue(
    "a page's halves BS rows apart",
    "smem_desc(v_t + (kk * 16 / BS) * BS * 256 + (kk * 16 % BS) * 128, BS * 128,\n"
    "                              BS == 8 ? 2 * GROUP_BYTES : GROUP_BYTES)").replace(
    "BLOCK_N", "KV_TILE")
PIN_S = r"""    for (int nt = 0; nt < NTILES; ++nt)
      for (int e = 0; e < 4; ++e) pin(s[0][nt][e]);
"""

# Grid: one block of THREADS per work item of an unsplit 128-row plan (KV_START = 0).
# In: q [T, H, 128], k_cache, v_cache (rows of [Hkv, 128], 16-bit), block_tables [S, MAX_BLOCKS],
# work [items, WORK_COLS], tmaps (uint8 [256]: the K and V map templates of these caches).
# Out: out [T, H, 128]; maps (uint8 [items * 256]: each block's K and V maps).
# Smem (1024-byte aligned): STAGES x [K tile [2][KV_TILE][64]][V tile: per page [2][BS][64]],
# swizzled; a K slot and a V slot each have a "full" barrier and an "empty" one.
KERNEL = r"""
  constexpr int D = HEAD_DIM, KSTEPS = D / 16, DTILES = D / 8, NTILES = KV_TILE / 8, MT = 1;
  constexpr int GROUP_BYTES = 8 * 128, HALF = KV_TILE * 64, TILE = KV_TILE * D;
  constexpr int PAGE_BYTES = BS * 256, PAGES_PER_TILE = KV_TILE / BS;
  static_assert(D == 128 && KV_TILE % BS == 0 && BS % 8 == 0, "boxes of whole swizzle atoms");
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem + ((1024 - (smem_addr(smem) & 1023)) & 1023));
  __shared__ __align__(128) unsigned char maps_s[2][128];
  __shared__ __align__(8) uint64_t full_k[STAGES], full_v[STAGES], empty_v[STAGES],
      empty_k[STAGES];

  const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int* item = work + static_cast<size_t>(blockIdx.x) * WORK_COLS;
  const int seq = item[W_SEQ], tok0 = item[W_TOK0], ntok = item[W_NTOK], pos0 = item[W_POS0];
  const int kvh = item[W_KV_HEAD], kv_start = item[W_KV_START], kv_end = item[W_KV_END];
  const int rows = ntok * GROUP;
  const int num_tiles = (kv_end - kv_start + KV_TILE - 1) / KV_TILE;
  unsigned char* maps_g = maps + static_cast<size_t>(blockIdx.x) * 256;

  if (tid < 32) {  // the block's K and V maps: the templates, with the caches' addresses
    const void* const bases[2] = {k_cache, v_cache};
    publish_maps<2>(lane, tmaps, bases, maps_s, maps_g);
    acquire_maps<2>(maps_g);  // every lane loads through them
    if (lane == 0) {
      for (int st = 0; st < STAGES; ++st) {
        mbar_init(smem_addr(&full_k[st]), 1);
        mbar_init(smem_addr(&full_v[st]), 1);
        mbar_init(smem_addr(&empty_v[st]), 256);  // every consumer thread
        mbar_init(smem_addr(&empty_k[st]), 256);
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
  }
  __syncthreads();

  if (wg == 0) {  // producer: warp 0; lane 2p + h loads half h of page p's K, lane p its V
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(PRODUCER_REGS));
    if (tid < 32) {
      const int* table = block_tables + static_cast<size_t>(seq) * MAX_BLOCKS;
      const int p = lane / 2, h = lane % 2;
      // the block id of page p of a tile at key n0, read a tile ahead of its loads
      auto block_of = [&](int n0) {
        return lane < 2 * PAGES_PER_TILE && n0 + p * BS < kv_end ? table[n0 / BS + p] : 0;
      };
      int next = block_of(kv_start);
      for (int t = 0; t < num_tiles; ++t) {
        const int stage = t % STAGES, phase = (t / STAGES) & 1;
        const int n0 = kv_start + t * KV_TILE;
        const int pages = min(PAGES_PER_TILE, (kv_end - n0 + BS - 1) / BS);
        const int block = next;
        if (t + 1 < num_tiles) next = block_of(n0 + KV_TILE);
        const uint32_t k_dst = smem_addr(sK + 2 * stage * TILE), v_dst = k_dst + TILE * 2;
        // K's slot frees once S is done, before V's
        mbar_wait(smem_addr(&empty_k[stage]), phase ^ 1);
        if (lane == 0) mbar_expect(smem_addr(&full_k[stage]), pages * PAGE_BYTES);
        __syncwarp();
        if (lane < 2 * pages)
          tma_load(k_dst + (h * HALF + p * BS * 64) * 2, maps_g, h * 64, kvh, block * BS,
                   smem_addr(&full_k[stage]));
        const int v_block = __shfl_sync(0xffffffff, block, (2 * lane) % 32);  // page `lane`'s
        mbar_wait(smem_addr(&empty_v[stage]), phase ^ 1);
        if (lane == 0) mbar_expect(smem_addr(&full_v[stage]), pages * PAGE_BYTES);
        __syncwarp();
        if (lane < pages)
          tma_load4(v_dst + lane * PAGE_BYTES, maps_g + 128, 0, v_block * BS, 0, kvh,
                    smem_addr(&full_v[stage]));
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(CONSUMER_REGS));

  const int row_lo = (wg - 1) * 64 + warp * 16 + lane / 4;
  const float scale_log2 = __int_as_float(QK_SCALE_BITS);""" + hp.Q_AND_STATE + r"""
  float s[MT][NTILES][4];
  uint32_t p[KV_TILE / 16][4];
  {  // S of the first tile, its softmax and P
    const int n0 = kv_start;
    const uint32_t k_t = smem_addr(sK);
    mbar_wait(smem_addr(&full_k[0]), 0);
""" + S_ISSUE + "    wgmma_wait();\n" + PIN_S + r"""    mbar_arrive(smem_addr(&empty_k[0]));
""" + ONLINE_SOFTMAX + P_FROM_S + r"""  }
  for (int t = 0; t + 1 < num_tiles; ++t) {  // S of tile t + 1 and O += P V of tile t at once
    const int stage = t % STAGES, phase = (t / STAGES) & 1;
    const int nstage = (t + 1) % STAGES, nphase = ((t + 1) / STAGES) & 1;
    const uint32_t v_t = smem_addr(sK + (2 * stage + 1) * TILE);
    const uint32_t k_t = smem_addr(sK + 2 * nstage * TILE);
    const int n0 = kv_start + (t + 1) * KV_TILE;
    mbar_wait(smem_addr(&full_v[stage]), phase);
    mbar_wait(smem_addr(&full_k[nstage]), nphase);
""" + S_ISSUE + PV_ISSUE + r"""    // S is done: its softmax runs while the tensor cores do P V
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
""" + PIN_S + r"""    mbar_arrive(smem_addr(&empty_k[nstage]));
""" + ONLINE_SOFTMAX + "    wgmma_wait();\n" + hp.PIN_O + r"""    mbar_arrive(smem_addr(&empty_v[stage]));
""" + cpa.RESCALE_O + P_FROM_S + r"""  }
  {  // O += P V of the last tile
    const int t = num_tiles - 1, stage = t % STAGES, phase = (t / STAGES) & 1;
    const int n0 = kv_start + t * KV_TILE;
    const uint32_t v_t = smem_addr(sK + (2 * stage + 1) * TILE);
    mbar_wait(smem_addr(&full_v[stage]), phase);
    if (n0 + KV_TILE > kv_end) {  // rows past the range hold other data: P is 0 there, V too
      T* v_s = sK + (2 * stage + 1) * TILE;
      for (int i = tid - 128; i < KV_TILE * 16; i += 256) {
        const int r = i / 16, c = i % 16;  // key r of the tile, 16-byte chunk c of its row
        if (n0 + r >= kv_end)
          *reinterpret_cast<uint4*>(v_s + (r / BS) * BS * 128 + (c / 8) * BS * 64 +
                                    (r % BS) * 64 + (c % 8) * 8) = make_uint4(0u, 0u, 0u, 0u);
      }
      fence_async_smem();
      asm volatile("bar.sync 1, 256;" ::: "memory");  // both consumers read the tile
    }
    wgmma_fence();
""" + PV_ISSUE + "    wgmma_wait();\n" + hp.PIN_O + r"""  }

  for (int i = 0; i < 2; ++i) {
    float l = l_run[0][i];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = row_lo + 8 * i;
    if (row >= rows) continue;
    T* dst = out + (static_cast<size_t>(tok0 + row / GROUP) * H + kvh * GROUP + row % GROUP) * D;
    const int col = (lane % 4) * 2;
    for (int dt = 0; dt < DTILES; ++dt)
      *reinterpret_cast<uint32_t*>(dst + dt * 8 + col) =
          Mma<T>::pack(o[0][dt][2 * i] * inv, o[0][dt][2 * i + 1] * inv);
  }
"""
_SOURCE_HASH = source_hash(hp.PRELUDE, hp.HEADER, tma.DEVICE, KERNEL,
                                   f"{BLOCK_M} {KV_TILE} {STAGES} {PRODUCER_REGS} {CONSUMER_REGS}")


def kernel_source(name: str, g: Geometry) -> str:
    """The whole translation unit of one variant: constants, helpers, the extern "C" kernel."""
    ab = "bf16" if g.dtype == mx.bfloat16 else "f16"
    constants = (f"typedef unsigned short T;\n#define AB \"{ab}\"\n"
                 f"constexpr int HEAD_DIM = {g.head_dim}, GROUP = {g.group}, BS = {g.block_size}, "
                 f"STAGES = {STAGES}, KV_TILE = {KV_TILE}, "
                 f"QK_SCALE_BITS = {cpa.qk_scale_bits(g.scale)}, PRODUCER_REGS = {PRODUCER_REGS}, "
                 f"CONSUMER_REGS = {CONSUMER_REGS};\n")
    params = ("const T* q, const T* k_cache, const T* v_cache, const int* block_tables, "
              "const int* work, const unsigned char* tmaps, T* out, unsigned char* maps, int H, "
              "int MAX_BLOCKS")
    return (hp.PRELUDE + constants + hp.HEADER + tma.DEVICE +
            f'extern "C" __global__ void __launch_bounds__({THREADS}, 1) {name}({params}) {{\n' +
            KERNEL + "}\n")


@dataclass(frozen=True)
class PrefillPlan(Plan):
    tiles: tile_plan.TilePlan


class HopperPrefillAttention:
    """The Hopper prefill kernel. `compile` turns a source into a cubin (NVRTC's, or a test's
    stand-in), `maps` encodes the caches' tensor-map templates."""

    name = "hopper prefill kernel"

    def __init__(self, compile=None, precompiled_kernel=None, maps=None):
        self._compile = compile or nvrtc.compile_cubin
        self._precompiled = precompiled_kernel or mx.fast.precompiled_cuda_kernel
        self._maps = maps or (lambda rows, bs, hkv: np.concatenate(
            [tma.k_map(rows, bs, hkv), tma.v_map(rows, bs, hkv)]))
        self._cubins: dict[tuple, tuple[str, bytes]] = {}
        self._templates: dict[tuple, mx.array] = {}

    def unsupported_reason(self, g: Geometry) -> str | None:
        # block sizes 8-32 (the shared rule's): whole swizzle atoms that tile KV_TILE
        return unsupported_reason(g, HEAD_DIMS) or cpa.scale_reason(g.scale)

    def canary_plannings(self, geometry: Geometry) -> tuple[dict, ...]:
        return ({},)

    def plan(self, lengths: Lengths, geometry: Geometry, block_tables: mx.array,
             seqs=None) -> PrefillPlan:
        refuse_unsupported(self, geometry)
        g, seqs = geometry, lengths.seqs(seqs)
        tiles = tile_plan.build_tile_plan(lengths.cu_seqlens_q, lengths.seq_lens, g.group,
                                          g.num_kv_heads, BLOCK_M, KV_TILE, cpa.NUM_SMS,
                                          min_items=0, seqs=np.asarray(seqs))
        return PrefillPlan(g, lengths, block_tables, seqs, tiles)

    def check(self, q, k, v, k_cache, v_cache, plan: PrefillPlan) -> None:
        check_call(self.name, plan.geometry, plan.lengths, q, k, v, k_cache, v_cache,
                   plan.block_tables)

    def run(self, q, k, v, k_cache, v_cache, plan: PrefillPlan, out=None) -> mx.array:
        return write_rows(out, self.launch(q, k_cache, v_cache, plan), plan)

    def launch(self, q: mx.array, k_cache: mx.array, v_cache: mx.array,
               plan: PrefillPlan) -> mx.array:
        g, tiles, block_tables = plan.geometry, plan.tiles, plan.block_tables
        key = (g.dtype, g.group, g.block_size, cpa.qk_scale_bits(g.scale))
        if key not in self._cubins:
            name = (f"paged_prefill_tma_{_SOURCE_HASH}_{dtype_name(g.dtype)}"
                    f"_g{g.group}_b{g.block_size}_q{key[3]:x}")
            self._cubins[key] = name, self._compile(kernel_source(name, g), name, hp.ARCH)
        name, cubin = self._cubins[key]
        rows = k_cache.nbytes // (g.num_kv_heads * g.head_dim * 2)
        shape = (rows, g.block_size, g.num_kv_heads)
        if shape not in self._templates:  # one per cache shape: a server's never changes
            self._templates[shape] = device_array(self._maps(*shape))
        return self._precompiled(
            name=name, compiled_source=cubin,
            inputs=[q, k_cache, v_cache, block_tables, tiles.work, self._templates[shape]],
            output_shapes=[q.shape, (max(tiles.num_items, 1) * 256,)],
            output_dtypes=[q.dtype, mx.uint8], scalars=[q.shape[1], block_tables.shape[1]],
            grid=(tiles.num_items * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            shared_memory=SMEM_BYTES, ensure_row_contiguous=True)[0]
