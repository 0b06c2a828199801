"""A prototype of the next Hopper paged kernel: warp-specialized, K/V pages loaded by TMA.

    python bench/hopper_ws_prototype.py [--out ws.json] [--points C16384_Lq512,...]  # sm_90, bf16

Not used by the runner. It checks, against the float64 oracle, and times, against the wgmma
kernel (`jit_kernels/hopper_paged_attention.py`) and cuDNN on contiguous K/V, the structure
cuDNN's and FlashAttention-3's kernels share, on paged K/V:

- a threadblock of three warpgroups: a producer and two consumers of 64 query rows each (a
  128-row tile, GQA rows packed as in `jit_kernels/plan.py`, which plans it unsplit);
- the producer's first warp loads each K/V tile of KV_TILE keys page by page with TMA, a box
  per lane (box: 64 elements of D, one kv head, one page, 128-byte swizzle, as
  `bench/tma_probe.py` checks), into a ring of STAGES stages; a K slot and a V slot each have a
  "full" barrier and an "empty" one the consumers release, K's as soon as S is done;
  `setmaxnreg` moves registers from the producer to the consumers;
- the consumers issue S of tile t + 1 and O += P V of tile t together and run the softmax of
  t + 1 while P V runs (FlashAttention-3's intra-warpgroup overlap), with the wgmma kernel's
  source pieces, and zero the V rows past the range in the last tile (they hold other data, NaN
  in the tests).

A tensor map holds its tensor's address, and MLX gives a kernel its arrays' addresses on the
device only: the host encodes one template per cache shape, and each block patches the caches'
addresses into its own copies (`tensormap.replace`), publishes them to global memory and fences
them for the TMA unit. What it lacks to be the runner's kernel: split KV and its merge, the
mixed path, fp16, the canary and the dispatcher's rule (docs/gpu.md, "Latest").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tma_probe import TMA_DEVICE, encode_template  # noqa: E402

from jit_kernels import cuda_paged_attention as cpa  # noqa: E402
from jit_kernels import hopper_paged_attention as hp  # noqa: E402
from jit_kernels import nvrtc, support  # noqa: E402
from jit_kernels import plan as tile_plan  # noqa: E402
from jit_kernels.support import Geometry  # noqa: E402

BLOCK_M = 128  # two consumer warpgroups of 64 rows
KV_TILE = 128  # keys a stage holds (64: 1.15x the time at C16384_Lq512, docs/gpu.md)
STAGES = 3  # V(t) stays while K(t + 1) and tile t + 2 land
THREADS = 384
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # 128 x 40 + 256 x 232 <= 64K registers

# The wgmma kernel's pieces at this tile width: the online softmax, P from S and the issues of
# S = Q K^T and O += P V
ONLINE_SOFTMAX = cpa.ONLINE_SOFTMAX.replace("BLOCK_N", "KV_TILE")
P_FROM_S = hp.P_FROM_S.replace("BLOCK_N", "KV_TILE")
PV_ISSUE = hp.PV_ISSUE.replace("BLOCK_N", "KV_TILE")
S_ISSUE = hp.s_issue(KV_TILE)
PIN_S = r"""    for (int nt = 0; nt < NTILES; ++nt)
      for (int e = 0; e < 4; ++e) pin(s[0][nt][e]);
"""

# Grid: one block of THREADS per work item of a 128-row unsplit plan (KV_START = 0).
# In: q [T, H, 128], k_cache, v_cache [rows, Hkv, 128] (bf16), block_tables [S, MAX_BLOCKS],
# work [items, WORK_COLS], tmap (uint8 [128]: the template for a [rows, Hkv, 128] cache).
# Out: out [T, H, 128]; maps (uint8 [items * 256]: each block's K and V tensor maps).
# Smem (1024-byte aligned): STAGES x [K tile][V tile], each [2][KV_TILE][64] swizzled; a K slot
# and a V slot each have a "full" barrier (the loads landed) and an "empty" one (read).
KERNEL = r"""
  constexpr int D = HEAD_DIM, KSTEPS = D / 16, DTILES = D / 8, NTILES = KV_TILE / 8, MT = 1;
  constexpr int GROUP_BYTES = 8 * 128, HALF = KV_TILE * 64, TILE = KV_TILE * D;
  constexpr int BOX_BYTES = BS * 128, PAGES_PER_TILE = KV_TILE / BS;
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

  if (tid < 32) {  // the block's K and V maps: the template, with the caches' addresses
    const void* const bases[2] = {k_cache, v_cache};
    publish_maps<2>(lane, tmap, bases, maps_s, maps_g);
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

  if (wg == 0) {  // producer: warp 0, a page's half-box per lane (one thread issuing them all
                  // took 1.09x the time at C16384_Lq512: the loads were the bottleneck)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(PRODUCER_REGS));
    if (tid < 32) {
      const int* table = block_tables + static_cast<size_t>(seq) * MAX_BLOCKS;
      for (int t = 0; t < num_tiles; ++t) {
        const int stage = t % STAGES, phase = (t / STAGES) & 1;
        const int n0 = kv_start + t * KV_TILE;
        const int pages = min(PAGES_PER_TILE, (kv_end - n0 + BS - 1) / BS);
        const uint32_t k_dst = smem_addr(sK + 2 * stage * TILE), v_dst = k_dst + TILE * 2;
        for (int kv = 0; kv < 2; ++kv) {  // K's slot frees once S is done, before V's
          mbar_wait(smem_addr(kv ? &empty_v[stage] : &empty_k[stage]), phase ^ 1);
          const uint32_t bar = smem_addr(kv ? &full_v[stage] : &full_k[stage]);
          if (lane == 0) mbar_expect(bar, pages * 2 * BOX_BYTES);
          __syncwarp();
          for (int i = lane; i < pages * 2; i += 32) {
            const int p = i / 2, h = i % 2;
            tma_load((kv ? v_dst : k_dst) + (h * HALF + p * BS * 64) * 2, maps_g + 128 * kv,
                     h * 64, kvh, table[n0 / BS + p] * BS, bar);
          }
        }
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
    // (FlashAttention-3's intra-warpgroup overlap)
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
        const int r = i / 16, c = i % 16;
        if (n0 + r >= kv_end)
          *reinterpret_cast<uint4*>(v_s + (c / 8) * HALF + r * 64 + (c % 8) * 8) =
              make_uint4(0u, 0u, 0u, 0u);
      }
      fence_async_smem();
      asm volatile("bar.sync 1, 256;" ::: "memory");  // both consumers read the tile
    }
""" + hp.PV_PRODUCT.replace("BLOCK_N", "KV_TILE") + r"""    mbar_arrive(smem_addr(&empty_v[stage]));
  }

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
_SOURCE_HASH = support.source_hash(hp.PRELUDE, hp.HEADER, TMA_DEVICE, KERNEL,
                                   f"{BLOCK_M} {KV_TILE} {STAGES} {PRODUCER_REGS} {CONSUMER_REGS}")


def kernel_source(name: str, g: Geometry) -> str:
    constants = ("typedef unsigned short T;\n#define AB \"bf16\"\n"
                 f"constexpr int HEAD_DIM = {g.head_dim}, GROUP = {g.group}, BS = {g.block_size}, "
                 f"STAGES = {STAGES}, KV_TILE = {KV_TILE}, "
                 f"QK_SCALE_BITS = {cpa.qk_scale_bits(g.scale)}, PRODUCER_REGS = {PRODUCER_REGS}, "
                 f"CONSUMER_REGS = {CONSUMER_REGS};\n")
    params = ("const T* q, const T* k_cache, const T* v_cache, const int* block_tables, "
              "const int* work, const unsigned char* tmap, T* out, unsigned char* maps, int H, "
              "int MAX_BLOCKS")
    return (hp.PRELUDE + constants + hp.HEADER + TMA_DEVICE +
            f'extern "C" __global__ void __launch_bounds__({THREADS}, 1) {name}({params}) {{\n' +
            KERNEL + "}\n")


class WsPrototype:
    """plan() once, then call; bf16, head dim 128, block sizes 8/16/32, caches as pages."""

    def __init__(self):
        self._cubins: dict = {}
        self._templates: dict = {}

    @staticmethod
    def plan(cu_seqlens_q, seq_lens, g: Geometry) -> tile_plan.TilePlan:
        if g.dtype != mx.bfloat16 or g.head_dim != 128:
            raise ValueError(f"geometry: the prototype runs bf16 at head dim 128, got "
                             f"{g.dtype} at {g.head_dim}")
        return tile_plan.build_tile_plan(cu_seqlens_q, seq_lens, g.group, g.num_kv_heads,
                                         BLOCK_M, KV_TILE, cpa.NUM_SMS, min_items=0)

    def __call__(self, q, k_cache, v_cache, block_tables, tiles, g: Geometry) -> mx.array:
        key = (g.group, g.block_size, cpa.qk_scale_bits(g.scale))
        if key not in self._cubins:
            name = (f"paged_prefill_ws_{_SOURCE_HASH}_g{g.group}_b{g.block_size}"
                    f"_q{key[2]:x}")
            self._cubins[key] = name, nvrtc.compile_cubin(kernel_source(name, g), name, "sm_90a")
        name, cubin = self._cubins[key]
        rows = k_cache.shape[0] * k_cache.shape[1]
        shape = (rows, g.block_size, g.num_kv_heads)
        if shape not in self._templates:
            self._templates[shape] = mx.array(encode_template(*shape))
        return mx.fast.precompiled_cuda_kernel(
            name=name, compiled_source=cubin,
            inputs=[q, k_cache, v_cache, block_tables, tiles.work, self._templates[shape]],
            output_shapes=[q.shape, (tiles.num_items * 256,)], output_dtypes=[q.dtype, mx.uint8],
            scalars=[q.shape[1], block_tables.shape[1]], grid=(tiles.num_items * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1), shared_memory=2 * STAGES * KV_TILE * g.head_dim * 2 + 1024,
            ensure_row_contiguous=True)[0]


CHECKS = [([512], [4096]), ([37], [0]), ([129], [1000]), ([300, 77, 5], [16, 2000, 3333]),
          ([64, 1, 200], [0, 511, 45]), ([1000], [17])]
POINTS = [("C16384_Lq512", 512, 16384), ("C4096_Lq512", 512, 4096), ("C1024_Lq512", 512, 1024),
          ("C0_Lq512", 512, 0), ("C4096_Lq256", 256, 4096), ("C16384_Lq128", 128, 16384),
          ("C0_Lq4096", 4096, 0)]


def check(ws: WsPrototype) -> list[dict]:
    """Against the float64 oracle, pages shuffled across a NaN-poisoned cache."""
    from tests.conftest import PagedCase, assert_close
    rows = []
    for bs in (8, 16, 32):
        for group, hkv in ((4, 8), (8, 2), (1, 8), (3, 4)):
            for q_lens, ctx in CHECKS if (bs, group) == (16, 4) else CHECKS[:3]:
                g = Geometry(group * hkv, hkv, 128, bs, mx.bfloat16, 128 ** -0.5)
                c = PagedCase(q_lens, ctx, g.num_heads, hkv, 128, bs, mx.bfloat16, seed=bs + group)
                out = ws(c.q, c.k_cache, c.v_cache, c.block_tables,
                         ws.plan(c.cu_seqlens_q, c.seq_lens, g), g)
                what = f"block {bs} group {group} q {q_lens} ctx {ctx}"
                try:
                    assert_close(out, c.oracle(g.scale), mx.bfloat16, what)
                    rows.append({"case": what, "ok": True})
                except AssertionError as error:
                    rows.append({"case": what, "ok": False, "error": str(error)[:300]})
                print(what, "ok" if rows[-1]["ok"] else rows[-1]["error"], flush=True)
    return rows


def timing(ws: WsPrototype, points: list) -> list[dict]:
    """us a call on the GPU alone: 20 calls together (the sweep's measure) and chained."""
    from jit_kernels import available_backends
    wgmma = available_backends()["cuda"].attention
    rows = []
    for name, lq, ctx in points:
        row = time_point(ws, wgmma, name, lq, ctx)
        rows.append(row)
        print(f"{name:<14} ceiling {row['ceiling_t']:7.1f} / {row['ceiling_c']:7.1f}  auto "
              f"({row['auto_path']}) {row['auto_t']:7.1f}  wgmma {row['wgmma_t']:7.1f} / "
              f"{row['wgmma_c']:7.1f}  ws {row['ws_t']:7.1f} / {row['ws_c']:7.1f} us "
              f"(together / chained)  ws {row['ws_tflops']:.0f} TFLOP/s", flush=True)
        mx.clear_cache()
    return rows


def time_point(ws: WsPrototype, wgmma, name: str, lq: int, ctx: int) -> dict:
    from attention_sweep import GEOMETRY, GPU_CALLS, Point, make_case, path_fns, point_cost
    from chained_attention import ceiling_gpu_us, copies_past_l2
    from gpu_time import gpu_us, gpu_us_together
    point = Point(name, [lq], [ctx])
    one = make_case(point)
    m, g = one.meta, GEOMETRY
    cu, lens = m.cu_seqlens_q_host, m.seq_lens_host
    fns, auto_path = path_fns(one, "cuda")
    copies = copies_past_l2(point, one)
    plan, tiles = wgmma.plan(cu, lens, g), ws.plan(cu, lens, g)

    def run_wgmma(x, c=one):
        return wgmma.launch(x, c.k_cache, c.v_cache, c.meta.block_tables, plan)

    def run_ws(x, c=one):
        return ws(x, c.k_cache, c.v_cache, c.meta.block_tables, tiles, g)
    repeats = [run_ws(one.q) for _ in range(4)]
    diff = mx.abs(repeats[0].astype(mx.float32) - run_wgmma(one.q).astype(mx.float32))
    row = {"point": name, "auto_path": auto_path, "items": tiles.num_items,
           "max_abs_diff_vs_wgmma": diff.max().item(),
           "repeats_bitwise_equal": all(mx.array_equal(repeats[0], r).item() for r in repeats),
           "ceiling_t": gpu_us_together([fns["ceiling"]] * GPU_CALLS),
           "auto_t": gpu_us_together([fns["auto"]] * GPU_CALLS),
           "wgmma_t": gpu_us_together([lambda: run_wgmma(one.q)] * GPU_CALLS),
           "ws_t": gpu_us_together([lambda: run_ws(one.q)] * GPU_CALLS),
           "ceiling_c": ceiling_gpu_us(copies),
           "wgmma_c": gpu_us([lambda x, c=c: run_wgmma(x, c) for c in copies], one.q),
           "ws_c": gpu_us([lambda x, c=c: run_ws(x, c) for c in copies], one.q)}
    flops = point_cost(point)[0]
    for path in ("ceiling", "wgmma", "ws"):
        row[f"{path}_tflops"] = flops / row[f"{path}_t"] / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--points", default=",".join(p[0] for p in POINTS),
                        help="the points to time, by name (comma-separated; none: checks only)")
    args = parser.parse_args()
    names = [n for n in args.points.split(",") if n]
    unknown = sorted(set(names) - {p[0] for p in POINTS})
    if unknown:
        raise SystemExit(f"--points: unknown {unknown}; known: {[p[0] for p in POINTS]}")
    why = hp.unavailable_reason()
    if why:
        raise SystemExit(f"needs a Hopper GPU: {why}")
    ws = WsPrototype()
    report = {"checks": check(ws), "timing": timing(ws, [p for p in POINTS if p[0] in names])}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if not all(r["ok"] for r in report["checks"]):
        raise SystemExit("the prototype disagrees with the oracle")
    if not all(r["repeats_bitwise_equal"] for r in report["timing"]):
        raise SystemExit("the prototype's repeated calls disagree")


if __name__ == "__main__":
    main()
