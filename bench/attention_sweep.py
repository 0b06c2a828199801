"""Paged-prefill attention sweep: every path against the contiguous-SDPA ceiling.

    python -m bench.attention_sweep --out sweep.json [--quick] [--only C4096_Lq16,...]

Points: H=32, Hkv=8, D=128, bf16, block 16, pages shuffled; context C in {0, 1024, 4096,
16384} x new tokens Lq in {1 (a batch of 32 decode rows, each with context C), 16, 64, 512,
4096}, plus a batch of 8 sequences with mixed prefix hits, plus sliding-window points
W<window>_C<cached>_... (a window of 4096 over contexts of 16384 and 32768). --quick (and any
machine without a GPU kernel backend) shrinks the sizes.

Paths: ceiling = SDPA on K/V that are already contiguous (no paging at all; at a windowed
point only the keys from the first one a new query sees, with the causal mask, so that cuDNN
runs it: its first queries see up to Lq - 1 keys past their window, work the other paths
skip); reference = MLX gather + SDPA; sdpa = SDPA over the new K/V (C = 0) or pages copied
by the backend's gather kernel; kernel = the backend's paged kernel; auto = the dispatcher's
choice for a shape asked for before (its long-run route: bench/steady_route.py); gather = the
gather kernel alone (its GB/s counts bytes read + written).

Per path: microseconds per call, TFLOP/s with FLOPs = 4 H D Lq (C + (Lq + 1) / 2) per
sequence (4 H D times the keys each query sees: its window's at a windowed point), and
effective GB/s = (visible K/V read + q + out bytes) / time. Timing: one mx.eval round trip
costs 50-100 us, so each sample evaluates K independent calls at once and divides; the
median of the samples is reported. That is host time per call wherever MLX's cost of building
and launching a call exceeds its GPU work, so on CUDA the ceiling, kernel and auto paths are
also timed on the GPU alone (`gpu_time.gpu_us_together`): GPU_CALLS of the same independent
calls evaluated together, per call (as here, every call reads the same K/V, which the L2 holds
where they fit; bench/chained_attention.py times layer-like chains through copies past it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

import reference
from bench.gpu_time import gpu_us_together
from bench.steady_route import steady_dispatcher
from jit_kernels import ContiguousSdpa, GatheredSdpa, available_backends
from jit_kernels.geometry import Geometry
from paged_prefix.attention_metadata import AttentionMetadata, build_attention_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, mx.bfloat16
GEOMETRY = Geometry(HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE, HEAD_DIM ** -0.5)
MIXED = ([512, 1, 64, 1, 16, 2048, 1, 128], [4096, 8000, 0, 300, 16384, 1024, 2000, 12000])
GPU_CALLS = 20  # calls evaluated together per GPU-alone sample (mixed8's ceiling: 8 launches each)
GPU_PATHS = ("ceiling", "kernel", "auto")


@dataclass
class Point:
    name: str
    q_lens: list[int]
    ctx_lens: list[int]
    window: int | None = None

    @property
    def geometry(self) -> Geometry:
        return replace(GEOMETRY, window=self.window)


def point_named(name: str) -> Point:
    """A one-sequence point by its sweep name, C<cached>_Lq<new>, or a decode batch,
    C<cached>_decode<rows>, either after W<window>_ for a windowed one; the sweep's points and
    others alike."""
    parts = name.split("_")
    window = int(parts.pop(0)[1:]) if parts[0].startswith("W") else None
    cached, new = int(parts[0][1:]), parts[1]
    if new.startswith("decode"):
        rows = int(new[len("decode"):])
        return Point(name, [1] * rows, [cached] * rows, window)
    return Point(name, [int(new[len("Lq"):])], [cached], window)


def sweep_points(quick: bool) -> list[Point]:
    contexts, q_lens, decode_batch = ([0, 256], [1, 16, 64], 4) if quick else (
        [0, 1024, 4096, 16384], [1, 16, 64, 512, 4096], 32)
    points = []
    for c in contexts:
        for lq in q_lens:
            if lq == 1:
                points.append(Point(f"C{c}_decode{decode_batch}", [1] * decode_batch,
                                    [c] * decode_batch))
            else:
                points.append(Point(f"C{c}_Lq{lq}", [lq], [c]))
    q_mixed, c_mixed = MIXED
    if quick:
        q_mixed, c_mixed = [max(1, q // 16) for q in q_mixed], [c // 16 for c in c_mixed]
    points.append(Point("mixed8", q_mixed, c_mixed))
    window, windowed = (64, ["C256_Lq16", "C256_decode4"]) if quick else (
        4096, ["C16384_Lq512", "C32768_Lq512", "C16384_Lq4096", "C32768_decode32"])
    points += [point_named(f"W{window}_{name}") for name in windowed]
    return points


@dataclass
class Case:
    q: mx.array
    k_new: mx.array  # [T, Hkv, D]: the new rows, what the sdpa path reads when C = 0
    v_new: mx.array
    k_cache: mx.array
    v_cache: mx.array
    meta: AttentionMetadata
    k_seqs: list[mx.array]  # contiguous [1, Hkv, L, D] per sequence (the ceiling's input)
    v_seqs: list[mx.array]
    q_seqs: list[mx.array]  # [1, H, Lq, D]


def make_case(point: Point, seed: int = 0) -> Case:
    """Random bf16 q/K/V; every sequence's pages shuffled across one cache."""
    rng = np.random.default_rng(seed)
    seq_lens = [q + c for q, c in zip(point.q_lens, point.ctx_lens)]
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(needed) + 1
    tables = np.split(rng.permutation(num_blocks)[: sum(needed)], np.cumsum(needed)[:-1])
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = mx.random.normal(shape, key=mx.random.key(seed)).astype(DTYPE)
    v_cache = mx.random.normal(shape, key=mx.random.key(seed + 1)).astype(DTYPE)
    q = mx.random.normal((sum(point.q_lens), HEADS, HEAD_DIM), key=mx.random.key(seed + 2))
    q = q.astype(DTYPE)
    meta = build_attention_metadata(point.q_lens, point.ctx_lens,
                                    [t.tolist() for t in tables], BLOCK_SIZE, num_blocks)
    k_seqs, v_seqs, q_seqs, k_new, v_new = [], [], [], [], []
    cu = meta.cu_seqlens_q_host
    for s, n in enumerate(seq_lens):
        k, v = reference.gather_kv(k_cache, v_cache, meta.block_tables[s], n)  # [1, Hkv, L, D]
        k_seqs.append(mx.contiguous(k))
        v_seqs.append(mx.contiguous(v))
        q_seqs.append(mx.contiguous(reference.heads_first(q[cu[s]:cu[s + 1]])))
        k_new.append(k[0, :, point.ctx_lens[s]:].transpose(1, 0, 2))
        v_new.append(v[0, :, point.ctx_lens[s]:].transpose(1, 0, 2))
    k_new, v_new = mx.concatenate(k_new), mx.concatenate(v_new)
    mx.eval(k_cache, v_cache, q, k_seqs, v_seqs, q_seqs, k_new, v_new)
    return Case(q, k_new, v_new, k_cache, v_cache, meta, k_seqs, v_seqs, q_seqs)


def ceiling_fn(case: Case, g: Geometry):
    """SDPA on already-contiguous K/V: what attention costs with no paging at all. With a
    window, over each sequence's keys from its first visible one (`key_starts`) on, copied out
    beforehand, with the causal mask: cuDNN's kernel, where a window's mask would take MLX's
    unfused fallback (docs/results.md, "Sliding windows")."""
    starts = case.meta.lengths.key_starts(g.window)
    ks = [mx.contiguous(k[:, :, int(s):]) for k, s in zip(case.k_seqs, starts)]
    vs = [mx.contiguous(v[:, :, int(s):]) for v, s in zip(case.v_seqs, starts)]
    mx.eval(ks, vs)
    decode = all(q.shape[2] == 1 for q in case.q_seqs) and len(case.q_seqs) > 1 and \
        len({k.shape[2] for k in ks}) == 1
    if decode:  # equal-length decode rows: one batched call
        qb, kb, vb = (mx.concatenate(x, axis=0) for x in (case.q_seqs, ks, vs))
        mx.eval(qb, kb, vb)
        return lambda: mx.fast.scaled_dot_product_attention(qb, kb, vb, scale=g.scale)
    return lambda: [
        mx.fast.scaled_dot_product_attention(q, k, v, scale=g.scale,
                                             mask="causal" if q.shape[2] > 1 else None)
        for q, k, v in zip(case.q_seqs, ks, vs)]


def checked(parts, args):
    """A call of executors as a lone caller makes it: each one's entry check, then its run."""
    def call():
        out = None
        for kernel, plan in parts:
            kernel.check(*args, plan)
            out = kernel.run(*args, plan, out)
        return out
    return call


def path_fns(case: Case, g: Geometry, backend_name: str | None) -> dict:
    """Each path as a zero-argument call, plans built once (as a forward would)."""
    m = case.meta
    lengths, tables = m.lengths, m.block_tables
    args = (case.q, case.k_new, case.v_new, case.k_cache, case.v_cache)
    fns = {"ceiling": ceiling_fn(case, g),
           "reference": lambda: reference.paged_attention(
               case.q, case.k_cache, case.v_cache, tables, lengths.cu_seqlens_q,
               lengths.seq_lens, g.scale, window=g.window)}
    backend = available_backends().get(backend_name)
    cached = tuple(s for s in range(lengths.num_seqs) if lengths.seq_lens[s] > lengths.q_lens[s])
    fresh = tuple(s for s in range(lengths.num_seqs) if s not in cached)
    gathered = backend.gathered if backend else GatheredSdpa()
    sdpa = [(ContiguousSdpa(), ContiguousSdpa().plan(lengths, g, tables, fresh))] if fresh else []
    if cached:
        sdpa.append((gathered, gathered.plan(lengths, g, tables, cached)))
    fns["sdpa"] = checked(sdpa, args)  # every cached prefix gathered
    if backend and backend.attention.unsupported_reason(g) is None:
        fns["kernel"] = checked([(backend.attention, backend.attention.plan(lengths, g, tables))],
                                args)
    if backend and cached and gathered is backend.gathered:
        gather_plan = sdpa[-1][1].gather

        def gather():
            backend.gathered.gather.check(case.k_cache, case.v_cache, gather_plan)
            return backend.gathered.gather.launch(case.k_cache, case.v_cache, tables,
                                                  gather_plan)
        fns["gather"] = gather
    dispatcher = steady_dispatcher()
    dispatcher.plan(m, g)  # a shape's first request runs the kernel (bench/steady_route.py)
    auto = dispatcher.plan(m, g)  # the route from then on
    fns["auto"] = lambda: auto(*args)
    return fns, auto.route.path


def time_per_call(fn, budget_s: float = 0.03, samples: int = 5) -> float:
    """Median seconds per call, K independent calls per mx.eval (K sized to ~budget_s)."""
    mx.eval(fn())  # build / compile / warm
    t0 = time.perf_counter()
    mx.eval(fn())
    once = time.perf_counter() - t0
    calls = max(1, min(200, int(budget_s / max(once, 1e-6))))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def point_cost(point: Point) -> tuple[float, float, float]:
    """(FLOPs, bytes moved by attention, bytes read + written by the gather) of one call: the
    keys each query sees, and the visible keys read, those of its window at a windowed point."""
    w = point.window
    seen = [sum(p + 1 if w is None else min(w, p + 1) for p in range(c, c + lq))
            for lq, c in zip(point.q_lens, point.ctx_lens)]
    visible = [lq + c - int(reference.key_start(c, w)) for lq, c in
               zip(point.q_lens, point.ctx_lens)]
    flops = sum(4 * HEADS * HEAD_DIM * n for n in seen)
    elem = 2  # bf16
    kv = sum(2 * n * KV_HEADS * HEAD_DIM * elem for n in visible)
    qo = 2 * sum(point.q_lens) * HEADS * HEAD_DIM * elem
    gathered = sum(2 * 2 * n * KV_HEADS * HEAD_DIM * elem
                   for n, c in zip(visible, point.ctx_lens) if c > 0)
    return flops, kv + qo, gathered


def run_point(point: Point, backend_name: str | None) -> dict:
    case = make_case(point)
    fns, auto_path = path_fns(case, point.geometry, backend_name)
    flops, nbytes, gathered = point_cost(point)
    row = {"point": point.name, "q_lens": point.q_lens, "ctx_lens": point.ctx_lens,
           "window": point.window, "flops": flops, "bytes": nbytes, "gather_bytes": gathered,
           "auto_path": auto_path}
    for name, fn in fns.items():
        sec = time_per_call(fn)
        moved = gathered if name == "gather" else nbytes
        row[name] = {"us": sec * 1e6, "tflops": flops / sec / 1e12, "gbps": moved / sec / 1e9}
    row["auto_over_ceiling"] = row["auto"]["us"] / row["ceiling"]["us"]
    if backend_name == "cuda":
        for name in (p for p in GPU_PATHS if p in fns):
            us = gpu_us_together([fns[name]] * GPU_CALLS)
            row[name].update(gpu_us=us, gpu_gbps=nbytes / us / 1e3)
        row["gpu_auto_over_ceiling"] = row["auto"]["gpu_us"] / row["ceiling"]["gpu_us"]
    del case, fns
    mx.clear_cache()
    return row


COLUMNS = ("ceiling", "reference", "sdpa", "kernel", "auto")


def print_table(rows: list[dict]) -> None:
    cols = [c for c in COLUMNS if c in rows[0]]
    gpu = "gpu_auto_over_ceiling" in rows[0]
    print(f"{'point':<16}" + "".join(f"{c + ' us':>12}" for c in cols)
          + f"{'kern GB/s':>10}{'gather GB/s':>12}{'auto/ceil':>10}  {'auto path':<10}"
          + (f"{'GPU alone: ceil us':>19}{'kern us':>9}{'auto us':>9}{'auto/ceil':>10}"
             f"{'auto GB/s':>10}" if gpu else ""))
    for r in rows:
        kern = f"{r['kernel']['gbps']:>10.0f}" if "kernel" in r else f"{'-':>10}"
        gath = f"{r['gather']['gbps']:>12.0f}" if "gather" in r else f"{'-':>12}"
        line = (f"{r['point']:<16}" + "".join(f"{r[c]['us']:>12.1f}" for c in cols) + kern
                + gath + f"{r['auto_over_ceiling']:>10.2f}  {r['auto_path']:<10}")
        if gpu:
            kern_us = f"{r['kernel']['gpu_us']:9.1f}" if "kernel" in r else f"{'-':>9}"
            line += (f"{r['ceiling']['gpu_us']:19.1f}{kern_us}"
                     f"{r['auto']['gpu_us']:9.1f}{r['gpu_auto_over_ceiling']:10.2f}"
                     f"{r['auto']['gpu_gbps']:10.0f}")
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/attention_sweep.json", help="JSON results path")
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    parser.add_argument("--only", default="", help="comma-separated point names to run")
    args = parser.parse_args()
    backend_name = next(iter(available_backends()), None)
    quick = args.quick or backend_name is None
    points = [p for p in sweep_points(quick) if not args.only or p.name in args.only.split(",")]
    rows = []
    for p in points:
        rows.append(run_point(p, backend_name))
        print(f"{p.name}: done", flush=True)
    print_table(rows)
    info = {"device": mx.device_info(), "backend": backend_name, "quick": quick,
            "dtype": str(DTYPE), "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
