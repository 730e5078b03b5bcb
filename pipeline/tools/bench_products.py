"""`scripts/bench products`: the CPU's bf16 products and expert kernels alone, in the bench's
process, on weights larger than the caches: each form this CPU has against oneDNN's packed
product (the linear layers), and the routed experts in one call against one expert at a time
(the mixture-of-experts layer), at the row counts asked for. Sides interleaved, the best of
--repeats each; the host's read bandwidth (roofline.read_bandwidth) measured before each row,
as it drifts. Shapes: Qwen3-30B-A3B's layer (hidden 2048, 32 + 4 heads of 128, experts of
768, 8 of 32 a token), as the mid-size benchmark MoE has it."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

HIDDEN, Q_KV, INTER, EXPERTS, TOP_K = 2048, 6144, 768, 32, 8
LAYERS = 8  # (the dense set: its 4 products a layer: 400 MB in bf16)


def add_products_parser(sub: Any) -> None:
    p = sub.add_parser("products", help="the bf16 products and expert kernels alone, "
                                        "against oneDNN's and one expert at a time")
    p.add_argument("--rows", default="1,8,32,128", help="comma list of row counts")
    p.add_argument("--repeats", type=int, default=5, help="runs a side, the best taken")
    p.set_defaults(func=products)


def _timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


Sides = tuple[dict[str, Callable[[], Any]], int, int]  # the runs, bytes read, FLOPs


def _linear_sides(rows: int) -> Sides:
    """Each product form of the dense layer set at `rows` rows, its weights' bytes and the
    FLOPs of a run."""
    import torch

    from stages.executor.linear.amx import pack, packed_method

    shapes = [(Q_KV, HIDDEN), (HIDDEN, 4096), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS
    weights = [torch.randn(n, k).bfloat16() for n, k in shapes]
    xs = {k: torch.randn(rows, k).bfloat16() for _, k in shapes}
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    sides = {"onednn-packed": lambda: [
        torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")
        for (_, k), p in zip(shapes, onednn, strict=True)]}
    method = packed_method()
    if method is not None:
        op = (torch.ops.llm_cpu.amx_linear if method.name == "amx-bf16"
              else torch.ops.llm_cpu.bf16_vector_linear)
        packed = [pack(w) for w in weights]
        sides[method.name] = lambda: [op(xs[k], p, None, n)
                                      for (n, k), p in zip(shapes, packed, strict=True)]
    params = sum(w.numel() for w in weights)
    return sides, 2 * params, 2 * rows * params


def _expert_sides(rows: int) -> Sides:
    """Layers of routed experts at `rows` tokens (random routing), in one moe_experts call
    and one expert at a time (bf16_vector_linear, as the per-expert layers run them); the
    routed experts' bytes, and the FLOPs (each token's k experts)."""
    import torch

    from stages.executor.linear.amx import interleave_gate_up, pack

    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        w13 = torch.stack([pack(interleave_gate_up(torch.randn(2 * INTER, HIDDEN).bfloat16()))
                           for _ in range(EXPERTS)])
        w2 = torch.stack([pack(torch.randn(HIDDEN, INTER).bfloat16()) for _ in range(EXPERTS)])
        weights, chosen = torch.topk(torch.rand(rows, EXPERTS, generator=g), TOP_K)
        layers.append((w13, w2, weights, chosen))
    x = torch.randn(rows, HIDDEN).bfloat16()

    def one_call() -> None:
        for w13, w2, weights, chosen in layers:
            torch.ops.llm_cpu.moe_experts(x, chosen, weights, w13, None, w2, None)

    def one_by_one() -> None:
        linear = torch.ops.llm_cpu.bf16_vector_linear
        for w13, w2, weights, chosen in layers:
            out = torch.zeros(rows, HIDDEN)
            for e in chosen.unique().tolist():
                token, slot = (chosen == e).nonzero(as_tuple=True)
                h = linear(x[token].contiguous(), w13[e], None, 2 * INTER, True)
                out.index_add_(0, token, linear(h, w2[e], None, HIDDEN).float()
                               * weights[token, slot, None])

    used = sum(len(chosen.unique()) for *_, chosen in layers)
    params = 3 * INTER * HIDDEN  # an expert's
    sides = {"moe_experts": one_call, "one by one": one_by_one}
    return sides, used * 2 * params, LAYERS * rows * TOP_K * 2 * params


def products(args: argparse.Namespace) -> int:
    import torch

    from pipeline.tools.roofline import read_bandwidth
    from stages.executor import kernels
    from stages.executor.linear.amx import vector_kernel_missing

    why = kernels.load()
    if why is not None:
        print(f"bench products: the CPU kernels are not available ({why})")
        return 1
    print(f"bench products: {torch.get_num_threads()} threads; GB/s of the weights read, "
          "and the host's read bandwidth before each row")
    for rows in (int(r) for r in args.rows.split(",")):
        rows_sides = [("linear", *_linear_sides(rows))]
        if vector_kernel_missing() is None:
            rows_sides.append(("experts", *_expert_sides(rows)))
        for what, sides, nbytes, flops in rows_sides:
            for run in sides.values():
                run()  # (warm)
            host = read_bandwidth()
            times = {name: float("inf") for name in sides}
            for _ in range(args.repeats):  # (interleaved: a round of every side at a time)
                for name, run in sides.items():
                    times[name] = min(times[name], _timed(run))
            cells = "  ".join(f"{name} {nbytes / t / 1e9:5.1f} GB/s "
                              f"{flops / t / 1e9:5.0f} GFLOP/s" for name, t in times.items())
            print(f"{what:8s} rows {rows:4d}  host {host:5.1f} GB/s  {cells}")
    return 0
