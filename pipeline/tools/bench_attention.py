"""`scripts/bench attention`: the CPU kernel's paged attention alone (torch.ops.llm_cpu.
paged_attention, one call a layer as the forward makes it), in the bench's process, for steps
of decodes at the contexts asked for: `--rows 1x1024,32x256` is one decode at position 1,024,
then 32 decodes at position 256 each. Each row calls the kernel on --layers caches in turn, as
a forward's layers do, so that a call's keys come from memory and not from the last call's
caches; the median of --repeats rounds, in µs a layer. The heads and the block size are the
default model's and the scheduler's unless given; the cache's format is each of --cache."""

from __future__ import annotations

import argparse
import time
from typing import Any

FORMATS = ("bf16", "int8", "fp8_e4m3", "fp8_e5m2")


def add_attention_parser(sub: Any) -> None:
    from ipc.config import SchedulerConfig

    p = sub.add_parser("attention", help="the CPU kernel's paged attention alone, decodes at "
                                         "the contexts asked for")
    p.add_argument("--rows", default="1x256,1x1024,1x4096,32x256,32x1024",
                   type=_rows, help="comma list of DECODESxPOSITION")
    p.add_argument("--cache", default="bf16", type=_formats,
                   help=f"comma list of the cache's formats ({', '.join(FORMATS)})")
    p.add_argument("--heads", type=int, default=9, help="query heads")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=SchedulerConfig.block_size)
    p.add_argument("--layers", type=int, default=30, help="caches called in turn")
    p.add_argument("--repeats", type=int, default=30, help="rounds over the layers, the "
                                                          "median taken")
    p.set_defaults(func=attention)


def _rows(text: str) -> list[tuple[int, int]]:
    rows = []
    for item in text.split(","):
        try:
            seqs, position = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r}: a row is DECODESxPOSITION, as 32x1024") from None
        if seqs < 1 or position < 0:
            raise argparse.ArgumentTypeError(f"{item!r}: at least one decode, a position >= 0")
        rows.append((seqs, position))
    return rows


def _formats(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in FORMATS]
    if unknown or not names:
        named = ", ".join(map(repr, unknown)) or repr(text)
        raise argparse.ArgumentTypeError(f"{named}: the formats are {', '.join(FORMATS)}")
    return names


def _cache(shape: tuple[int, ...], fmt: str, gen: Any) -> Any:
    """A cache [2, NB, BS, KVH, D] of random keys and values in `fmt` (int8: codes and an
    fp16 scale a row, its last two bytes, as kv_formats.h holds them)."""
    import torch

    if fmt == "int8":
        codes = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
        scale = torch.full((*shape[:-1], 1), 0.01, dtype=torch.float16).view(torch.int8)
        return torch.cat([codes, scale], dim=-1)
    values = torch.randn(shape, generator=gen)
    dtype = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}[fmt]
    return values.to(dtype)


def time_row(args: argparse.Namespace, seqs: int, position: int, fmt: str) -> float:
    """µs a layer of one call for `seqs` decodes at `position` over a `fmt` cache."""
    import torch

    gen = torch.Generator().manual_seed(0)
    d, kvh, block = args.head_dim, args.kv_heads, args.block_size
    pages = position // block + 1
    blocks = seqs * pages
    caches = [_cache((2, blocks, block, kvh, d), fmt, gen) for _ in range(args.layers)]
    table = torch.randperm(blocks, generator=gen).int().view(seqs, pages)
    q = torch.randn(seqs, args.heads, d, generator=gen).bfloat16()
    k = torch.randn(seqs, kvh, d, generator=gen).bfloat16()
    v = torch.randn(seqs, kvh, d, generator=gen).bfloat16()
    slots = torch.arange(seqs)
    positions = torch.full((seqs,), position)
    cos = torch.randn(position + 1, d)
    sin = torch.randn(position + 1, d)
    attend = torch.ops.llm_cpu.paged_attention
    times = []
    for _ in range(args.repeats + 1):  # (the first: the pages faulted in)
        start = time.perf_counter()
        for cache in caches:
            attend(q, k, v, cache, table, slots, positions, cos, sin, d ** -0.5, 0, 0.0, None)
        times.append((time.perf_counter() - start) / args.layers)
    times = sorted(times[1:])
    return times[len(times) // 2] * 1e6


def attention(args: argparse.Namespace) -> int:
    import torch

    from stages.executor import kernels

    missing = kernels.load()
    if missing is not None:
        print(f"bench attention: the CPU kernels did not load: {missing}")
        return 1
    print(f"paged attention, {args.heads} query heads, {args.kv_heads} KV heads of "
          f"{args.head_dim}, block {args.block_size}, {args.layers} caches in turn, "
          f"{torch.get_num_threads()} threads; median of {args.repeats}, µs a layer")
    print(f"{'decodes x position':<20}" + "".join(f"{fmt:>12}" for fmt in args.cache))
    for seqs, position in args.rows:
        cells = [time_row(args, seqs, position, fmt) for fmt in args.cache]
        print(f"{f'{seqs} x {position}':<20}" + "".join(f"{us:>12.1f}" for us in cells),
              flush=True)
    return 0
