"""LoRA adapters (ipc/lora.py, stages/executor/lora.py): a batch mixing the base model and two
PEFT adapters gives, per request, the greedy tokens of that adapter merged into the weights
(peft's merge_and_unload) and run alone; the segmented product equals the dense one; an
adapter's prefix-cache keys are its own; what is not run is refused by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from kernel_marks import needs_kernels
from tiny_model import build_tiny_llama

from ipc.errors import ConfigError
from ipc.lora import LoraConfig, read_adapter
from ipc.messages import LoraLoad, SamplingParams, TokenizedRequest
from stages.executor import kernels
from stages.executor.linear.base import Linear
from stages.executor.linear.dense import DenseMethod
from stages.executor.lora import LoraMethod, LoraState, LoraWeights, step_adapters
from stages.inprocess import InProcessEngine
from stages.scheduler.adapters import AdapterSlots
from stages.scheduler.sequence import Sequence

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, rank, alpha, targets, rslora)
ADAPTERS = [("alpha", 4, 8, ALL, False), ("beta", 8, 4, ["q_proj", "v_proj", "down_proj"], True)]
PROMPTS = [[1, 5, 9, 23, 42, 7], [3, 3, 8, 100, 64, 12, 9, 31, 2, 77, 15], [200, 11, 4],
           [17, 29, 5, 61, 88, 90, 13, 6, 44]]


def make_adapter(base: Path, out: Path, rank: int, alpha: int, targets: list[str],
                 rslora: bool, seed: int) -> None:
    """A PEFT adapter over `base` with random, non-zero lora_B (init_lora_weights=False)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_cfg = PeftLoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                              init_lora_weights=False, use_rslora=rslora)
    get_peft_model(model, peft_cfg).save_pretrained(out)


def merge_adapter(base: Path, adapter: Path, out: Path) -> None:
    """The reference: the adapter merged into a copy of the base model's weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_llama(root / "base")
    out = {"": base}
    for i, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        make_adapter(base, root / name, rank, alpha, targets, rslora, seed=10 + i)
        merge_adapter(base, root / name, root / f"{name}-merged")
        out[name] = root / name
        out[f"{name}-merged"] = root / f"{name}-merged"
    return out


def lora_config(folders: dict[str, Path]) -> LoraConfig:
    return LoraConfig(modules=tuple((name, str(folders[name])) for name, *_ in ADAPTERS),
                      max_loras=2, max_lora_rank=8)


def engine(folder: Path, **kw: object) -> InProcessEngine:
    return InProcessEngine(str(folder), max_num_seqs=8, max_num_batched_tokens=32,
                           **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_mixed_batch_equals_merged_adapters(folders: dict[str, Path],
                                            cpu_kernels: bool) -> None:
    if cpu_kernels and not kernels.available():
        pytest.skip("no CPU kernels here")
    greedy = {name: SamplingParams(max_tokens=12, temperature=0.0, lora_name=name)
              for name in ("", "alpha", "beta")}
    want = {}
    for name in greedy:
        alone = engine(folders[f"{name}-merged" if name else ""], cpu_kernels=cpu_kernels)
        want[name] = alone.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    assert want["alpha"] != want[""] and want["beta"] != want[""]  # (the adapters matter)
    eng = engine(folders[""], cpu_kernels=cpu_kernels, lora=lora_config(folders))
    lora = eng.runner.model.lora
    assert lora is not None and lora.kernel == cpu_kernels  # (the segmented kernel, or torch)
    # (steps of the base model's rows alone keep the fused call; the last layer is trimmed)
    assert (eng.runner.model.fused_layers is not None) == cpu_kernels
    assert eng.runner.model.trim_last_layer
    # every prompt under every adapter and the base model, interleaved in one batch
    requests = [(f"{name}-{i}", ids, greedy[name]) for i, ids in enumerate(PROMPTS)
                for name in greedy]
    results = eng.run(requests)
    for name in greedy:
        got = [results[f"{name}-{i}", 0].token_ids for i in range(len(PROMPTS))]
        assert got == want[name], name
    # the base model's rows alone (on the kernels: the fused call) on the adapters' engine
    assert eng.generate(PROMPTS[::-1], greedy[""]) == want[""][::-1]
    # again: each prompt's blocks are now cached under its own adapter's keys only
    hits = eng.scheduler.prefix_cache_hits
    again = eng.run([(f"again-{rid}", ids, p) for rid, ids, p in requests])
    assert eng.scheduler.prefix_cache_hits > hits
    for name in greedy:
        got = [again[f"again-{name}-{i}", 0].token_ids for i in range(len(PROMPTS))]
        assert got == want[name], name


@needs_kernels
@pytest.mark.parametrize(("dtype", "pairs"), [(torch.float32, False), (torch.bfloat16, False),
                                              (torch.bfloat16, True)])
def test_kernel_gives_each_part_its_own_block(dtype: torch.dtype, pairs: bool) -> None:
    """The kernel on a fused projection (parts of 40, 24 and 24 outputs; 37 inputs: a tail
    past the last whole vector, and an odd count for bf16 pairs; ranks 3 and 5) with adapters
    on some parts only: each token gets its own adapter's parts, the others' outputs
    untouched, and a token's result does not depend on the step's other tokens (alone, it is
    the same to the bit)."""
    from stages.executor.lora import _fused_pair

    if pairs and not torch.ops.llm_cpu.lora_bf16_pairs():
        pytest.skip("this CPU has no AVX512-BF16")
    g = torch.Generator().manual_seed(1)
    state = LoraState(max_loras=2, kernel=True, pairs=pairs)
    layer = Linear(37, 88, False, LoraMethod(DenseMethod(), state))
    layer.parts = (40, 24, 24)
    layer.weight.data = torch.randn(88, 37, generator=g).to(dtype)
    layer.method.process(layer)
    dense = {}
    for adapter, rank, parts in ((1, 3, (0, 2)), (2, 5, (1,))):
        ab = {p: (torch.randn(rank, 37, generator=g),
                  torch.randn(layer.parts[p], rank, generator=g)) for p in parts}
        spec = dataclasses.make_dataclass("Spec", ["name", "rank", "scale"])("x", rank, 0.5)
        w = _fused_pair(layer, ab, spec, dtype)  # type: ignore[arg-type]
        state.weights.setdefault(layer, {})[adapter] = w
        dense[adapter] = (w.b.float() @ w.a.float())
        for p in range(3):  # (a part it does not target: its outputs' rows of B are zero)
            start = sum(layer.parts[:p])
            assert (dense[adapter][start:start + layer.parts[p]] != 0).any() == (p in parts)
    adapters = np.array([2, 0, 1, 1, 2, 1, 1, 1, 2], dtype=np.int32)
    query = np.array([1, 2, 1, 3, 1, 1, 1, 1, 2], dtype=np.int32)
    x = torch.randn(int(query.sum()), 37, generator=g).to(dtype)
    state.step = step_adapters(adapters, query)
    y = layer(x)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    pack = state.packs[layer][:3]
    deltas = torch.zeros(len(x), 88, dtype=dtype)
    torch.ops.llm_cpu.lora_add(deltas, x, state.step.rows, state.step.groups, *pack, pairs)
    for t, a in enumerate(np.repeat(adapters, query).tolist()):
        w = layer.weight.float() + dense.get(a, 0)
        torch.testing.assert_close(y[t].float(), x[t].float() @ w.T, **tol)  # type: ignore[arg-type]
        alone = step_adapters(np.array([a], dtype=np.int32), np.array([1], dtype=np.int32))
        delta = torch.zeros(1, 88, dtype=dtype)
        if alone is not None:
            torch.ops.llm_cpu.lora_add(delta, x[t:t + 1], alone.rows, alone.groups, *pack,
                                       pairs)
        assert torch.equal(delta[0], deltas[t])


def test_fused_gate_up_keeps_its_activation_and_takes_adapters_interleaved() -> None:
    """bf16's packed gate/up product (amx.py: gate and up interleaved 16 at a time, silu in
    its pass) with adapters on the kernel: a step without adapted rows is the product without
    LoRA, to the bit; a step with them adds each token's adapter to its gate and up columns,
    wherever the interleaving put them."""
    from stages.executor.linear.amx import packed_method
    from stages.executor.lora import _fused_pair

    method = packed_method() if kernels.available() else None
    if method is None:
        pytest.skip("no packed bf16 form on this CPU")
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(128, 64, generator=g).to(torch.bfloat16)
    plain = Linear(64, 128, False, method())
    state = LoraState(max_loras=1, kernel=True, pairs=bool(torch.ops.llm_cpu.lora_bf16_pairs()))
    layer = Linear(64, 128, False, LoraMethod(method(), state))
    for each in (plain, layer):
        each.gated, each.parts = True, (64, 64)
        each.weight.data = weight.clone()
        each.method.process(each)
    assert layer.fused_gate
    ab = {p: (torch.randn(4, 64, generator=g), torch.randn(64, 4, generator=g)) for p in (0, 1)}
    spec = dataclasses.make_dataclass("Spec", ["name", "rank", "scale"])("x", 4, 0.5)
    w = _fused_pair(layer, ab, spec, torch.bfloat16)  # type: ignore[arg-type]
    state.weights[layer] = {1: w}

    def silu_and_mul(y: torch.Tensor) -> torch.Tensor:
        gate, up = y.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up).to(y.dtype)

    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(layer.gated_forward(x, silu_and_mul), plain.gated_forward(x, silu_and_mul))
    # (the activation reads interleaved columns in place: the bits of them put back in order)
    y = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    in_order = y.view(3, -1, 2, 16).transpose(1, 2).reshape(3, -1).contiguous()
    assert torch.equal(torch.ops.llm_cpu.silu_and_mul(y, True),
                       torch.ops.llm_cpu.silu_and_mul(in_order))
    state.step = step_adapters(np.array([1, 0, 1], dtype=np.int32),
                               np.array([2, 1, 2], dtype=np.int32))
    got = layer.gated_forward(x, silu_and_mul).float()
    merged = weight.float() + w.b.float() @ w.a.float()
    for t, adapter in enumerate([1, 1, 0, 1, 1]):
        want = silu_and_mul(x[t:t + 1].float() @ (merged if adapter else weight.float()).T)
        scale = float(want.abs().max())  # (bf16 rounds gate and up before their product)
        torch.testing.assert_close(got[t], want[0], rtol=0.0, atol=2e-2 * scale)


def test_a_layer_its_format_hands_on_keeps_its_adapters() -> None:
    """bf16's packed forms hand a layer whose inputs are not a multiple of 32 to oneDNN's
    (OneDnnPackedMethod.take): the layer stays wrapped, and its adapter is added."""
    from stages.executor.linear.amx import packed_method

    method = packed_method() if kernels.available() else None
    if method is None:
        pytest.skip("no packed bf16 form on this CPU")
    g = torch.Generator().manual_seed(3)
    state = LoraState(max_loras=1, kernel=True, pairs=bool(torch.ops.llm_cpu.lora_bf16_pairs()))
    layer = Linear(40, 32, False, LoraMethod(method(), state))
    layer.weight.data = torch.randn(32, 40, generator=g).to(torch.bfloat16)
    weight = layer.weight.data.float()
    layer.method.process(layer)
    assert isinstance(layer.method, LoraMethod) and layer.method.base.name == "onednn-packed"
    a, b = torch.randn(4, 40, generator=g), torch.randn(32, 4, generator=g)
    state.weights[layer] = {1: LoraWeights(a.to(torch.bfloat16), b.to(torch.bfloat16))}
    state.step = step_adapters(np.array([1], dtype=np.int32), np.array([2], dtype=np.int32))
    x = torch.randn(2, 40, generator=g).to(torch.bfloat16)
    want = x.float() @ (weight + b.to(torch.bfloat16).float() @ a.to(torch.bfloat16).float()).T
    scale = float(want.abs().max())
    torch.testing.assert_close(layer(x).float(), want, rtol=0.0, atol=2e-2 * scale)


@needs_kernels
def test_bf16_adapters_mixed_give_their_tokens_alone(folders: dict[str, Path]) -> None:
    """bf16 on the kernels (AVX512-BF16's pairs where the CPU has them): each request's tokens
    in a batch mixing both adapters and the base model are those it gets alone, a row's
    products not depending on the rows beside it."""
    eng = engine(folders[""], dtype=torch.bfloat16, lora=lora_config(folders))
    lora = eng.runner.model.lora
    assert lora is not None and lora.kernel
    assert lora.pairs == bool(torch.ops.llm_cpu.lora_bf16_pairs())
    greedy = {name: SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                   lora_name=name) for name in ("", "alpha", "beta")}
    alone = {name: eng.generate(PROMPTS, p) for name, p in greedy.items()}
    assert alone["alpha"] != alone[""] and alone["beta"] != alone[""]
    mixed = eng.run([(f"{name}-{i}", ids, greedy[name]) for i, ids in enumerate(PROMPTS)
                     for name in greedy])
    for name in greedy:
        assert [mixed[f"{name}-{i}", 0].token_ids for i in range(len(PROMPTS))] == alone[name]


def test_runtime_adapters_swap_through_one_slot(folders: dict[str, Path],
                                                tmp_path: Path) -> None:
    """Adapters loaded at run time (a folder in the params, --enable-lora-updating) share one
    slot: alpha's and beta's requests never run together, each gets its merged tokens; a
    name loaded again from another folder takes a new id (its old KV is never served).
    Start-time adapters beyond --max-loras swap the same way."""
    greedy = {name: SamplingParams(max_tokens=8, temperature=0.0, lora_name=name,
                                   lora_path=str(folders[name]) if name else "")
              for name in ("", "alpha", "beta")}
    want = {name: engine(folders[f"{name}-merged" if name else ""], cpu_kernels=False).generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0.0)) for name in greedy}
    eng = engine(folders[""], cpu_kernels=False,
                 lora=LoraConfig(max_loras=1, max_lora_rank=8, runtime_updating=True))
    requests = [(f"{name}-{i}", ids, greedy[name]) for i, ids in enumerate(PROMPTS)
                for name in greedy]
    results = eng.run(requests)
    for name in greedy:
        assert [results[f"{name}-{i}", 0].token_ids for i in range(len(PROMPTS))] == want[name]
    state = eng.runner.model.lora
    assert state is not None and len(state.loaded) == 1  # (one slot: swapped, never both)
    # "alpha" again, now from beta's weights: a new id, beta's tokens, none of alpha's KV
    shutil.copytree(folders["beta"], tmp_path / "alpha2")
    again = SamplingParams(max_tokens=8, temperature=0.0, lora_name="alpha",
                           lora_path=str(tmp_path / "alpha2"))
    results = eng.run([(f"re-{i}", ids, again) for i, ids in enumerate(PROMPTS)])
    assert [results[f"re-{i}", 0].token_ids for i in range(len(PROMPTS))] == want["beta"]
    assert sorted(eng.scheduler.builder.adapters.resident) == [3]
    # more --lora-modules than --max-loras: swapped the same way, by their own folders
    eng = engine(folders[""], cpu_kernels=False,
                 lora=dataclasses.replace(lora_config(folders), max_loras=1))
    results = eng.run([(rid, ids, dataclasses.replace(p, lora_path=""))
                       for rid, ids, p in requests])
    for name in greedy:
        assert [results[f"{name}-{i}", 0].token_ids for i in range(len(PROMPTS))] == want[name]


def test_runtime_slots_wait_for_an_idle_adapter() -> None:
    slots = AdapterSlots(("fixed",), ("/fixed",), 2)
    fixed = SamplingParams(lora_name="fixed")
    one = SamplingParams(lora_name="a", lora_path="/a")
    two = SamplingParams(lora_name="b", lora_path="/b")
    assert (slots.id_of(fixed), slots.id_of(one), slots.id_of(two), slots.id_of(one),
            slots.id_of(SamplingParams())) == (1, 2, 3, 2, 0)
    loads: list[LoraLoad] = []
    evictions: list[int] = []
    assert slots.take(1, fixed, [], loads, evictions)
    assert slots.take(2, one, [1], loads, evictions)
    assert loads == [LoraLoad(1, "fixed", "/fixed"), LoraLoad(2, "a", "/a")]
    assert not slots.take(3, two, [2, 0, 1], loads, evictions)  # (both slots' run)
    assert slots.take(3, two, [0, 1], loads, evictions) and evictions == [2]  # (2: idle)
    assert list(slots.resident) == [1, 3] and loads[-1] == LoraLoad(3, "b", "/b")
    assert AdapterSlots(("fixed",), ("/fixed",), 0).take(1, fixed, [], loads, evictions)
    assert len(loads) == 3  # (no swapping: --lora-modules adapters stay loaded)


def test_runtime_adapters_refused_unless_enabled(folders: dict[str, Path]) -> None:
    eng = engine(folders[""], cpu_kernels=False, lora=lora_config(folders))
    params = SamplingParams(max_tokens=2, lora_name="gamma", lora_path=str(folders["alpha"]))
    eng.scheduler.add_request(TokenizedRequest("x", "", PROMPTS[0], params, 0.0))
    (rejected,) = eng.scheduler.take_outputs().rejected
    assert "--enable-lora-updating" in rejected.error
    assert LoraConfig(modules=(("a", "x"),), max_loras=1).swap_slots == 0  # (all stay)
    assert LoraConfig(modules=(("a", "x"), ("b", "y")), max_loras=1).swap_slots == 1
    assert LoraConfig(modules=(("a", "x"),), max_loras=2, runtime_updating=True).swap_slots == 2


@pytest.mark.parametrize("kernel", [False, True])
def test_segmented_product_equals_dense(kernel: bool) -> None:
    """Each row's output is x (W + B_a A_a)^T of its own adapter a (0: W alone), in torch's
    products and the kernel's."""
    if kernel and not kernels.available():
        pytest.skip("no CPU kernels here")
    g = torch.Generator().manual_seed(0)
    state = LoraState(max_loras=3, kernel=kernel)
    layer = Linear(16, 24, True, LoraMethod(DenseMethod(), state))
    layer.weight.data = torch.randn(24, 16, generator=g)
    layer.bias.data = torch.randn(24, generator=g)
    layer.method.process(layer)
    deltas = {}
    for adapter, rank in ((1, 2), (3, 5)):
        a, b = torch.randn(rank, 16, generator=g), torch.randn(24, rank, generator=g)
        state.weights.setdefault(layer, {})[adapter] = LoraWeights(a, b)
        deltas[adapter] = b @ a
    adapters = np.array([0, 3, 1, 0, 3], dtype=np.int32)
    query = np.array([2, 1, 3, 1, 2], dtype=np.int32)
    x = torch.randn(int(query.sum()), 16, generator=g)
    state.step = step_adapters(adapters, query)
    y = layer(x)
    per_token = np.repeat(adapters, query)
    for t, a in enumerate(per_token.tolist()):
        w = layer.weight + deltas.get(a, 0)
        torch.testing.assert_close(y[t], x[t] @ w.T + layer.bias, rtol=1e-5, atol=1e-5)
    assert step_adapters(np.zeros(4, dtype=np.int32), query[:4]) is None
    a, b = torch.randn(3, 16, generator=g), torch.randn(24, 3, generator=g)
    state.weights[layer][2] = LoraWeights(a, b)  # (loaded later: the stack is made again)
    state.step = step_adapters(np.array([2, 1, 0], dtype=np.int32), query[:3])
    y = layer(x[:6])
    for t, w in enumerate([b @ a] * 2 + [deltas[1]] + [0] * 3):
        torch.testing.assert_close(y[t], x[t] @ (layer.weight + w).T + layer.bias,
                                   rtol=1e-5, atol=1e-5)
    state.step = step_adapters(np.full(5, 3, dtype=np.int32), query)  # (every row one's)
    torch.testing.assert_close(layer(x), x @ (layer.weight + deltas[3]).T + layer.bias,
                               rtol=1e-5, atol=1e-5)


def test_prefix_keys_depend_on_the_adapter() -> None:
    params = SamplingParams()
    keys = [Sequence("r", list(range(8)), params, 0.0, adapter_id=a).keys_for(2, 4)
            for a in (0, 1, 2)]
    assert len({k[0] for k in keys}) == 3 and len({k[1] for k in keys}) == 3
    assert Sequence("s", list(range(8)), params, 0.0).keys_for(2, 4) == keys[0]


def test_unknown_adapter_is_refused(folders: dict[str, Path]) -> None:
    eng = engine(folders[""], cpu_kernels=False, lora=lora_config(folders))
    params = SamplingParams(max_tokens=2, lora_name="gamma")
    eng.scheduler.add_request(TokenizedRequest("x", "", PROMPTS[0], params, 0.0))
    (rejected,) = eng.scheduler.take_outputs().rejected
    assert rejected.error == ("no LoRA adapter 'gamma' is served (adapters: alpha, beta)")


def test_refused_by_name(folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exceeds --max-lora-rank 4"):
        read_adapter("beta", str(folders["beta"]), 4)
    for key, value, what in (("use_dora", True, "DoRA"), ("bias", "all", "bias 'all'"),
                             ("modules_to_save", ["lm_head"], "modules_to_save")):
        bad = tmp_path / key
        shutil.copytree(folders["alpha"], bad)
        cfg = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ConfigError, match=what):
            read_adapter("bad", str(bad), 16)
    spec = read_adapter("beta", str(folders["beta"]), 8)
    assert spec.rank == 8 and spec.scale == pytest.approx(4 / 8 ** 0.5)  # rslora
    assert spec.targets == ("down_proj", "q_proj", "v_proj")


def test_router_keys_depend_on_the_adapter() -> None:
    from stages.router import EngineRouter, block_keys

    ids = list(range(8))
    assert block_keys(ids, 4, 1) != block_keys(ids, 4) != block_keys(ids, 4, 2)
    router = EngineRouter(2, 4, lora_names=("alpha",))
    first = router.route(ids, 8)
    router.set_loads([100, 0] if first == 0 else [0, 100], [True, True])
    # the base model's blocks went to `first`; the adapter's prompt matches nothing there
    assert router.match(ids).num_blocks == 2 and router.match(ids, "alpha").num_blocks == 0
    assert router.route(ids, 8, "alpha") != first
    assert router.match(ids, "alpha").num_blocks == 2
    router.set_loads([100, 0] if first == 0 else [0, 100], [True, True])
    assert router.route(ids, 8, "gamma") != first  # (loaded at run time: its own keys too)


def test_preflight_refuses_what_adapters_do_not_run_with(folders: dict[str, Path]) -> None:
    import dataclasses

    from ipc.config import ExecutorConfig, PipelineConfig, SchedulerConfig
    from ipc.model_info import ModelInfo
    from ipc.speculative import parse_speculative
    from stages.executor.preflight import check_executor

    cfg = PipelineConfig(model=ModelInfo.from_dir(str(folders[""])), lora=lora_config(folders))
    check_executor(cfg)  # (the adapters as they are: accepted)
    for change, what in (
            ({"executor": ExecutorConfig(tensor_parallel_size=2)}, "--tensor-parallel-size"),
            ({"executor": ExecutorConfig(compile=True)}, "--compile"),
            ({"executor": ExecutorConfig(device="cuda")}, "--device cuda"),
            ({"scheduler": SchedulerConfig(speculative=parse_speculative("ngram:2"))},
             "--speculative"),
            ({"lora": LoraConfig(modules=(("beta", str(folders["beta"])),), max_lora_rank=4)},
             "exceeds --max-lora-rank 4")):
        with pytest.raises(ConfigError, match=what):
            check_executor(dataclasses.replace(cfg, **change))
    # runtime loading alone (no --lora-modules) is refused the same way, under its own flag
    runtime = dataclasses.replace(cfg, lora=LoraConfig(runtime_updating=True),
                                  executor=ExecutorConfig(compile=True))
    with pytest.raises(ConfigError, match="--enable-lora-updating: --compile"):
        check_executor(runtime)


def test_bench_lora_runs_every_row(folders: dict[str, Path], tmp_path: Path) -> None:
    from pipeline.tools.bench import main

    out = tmp_path / "lora.json"
    assert main(["lora", "--model", str(folders[""]), "--batch", "3", "--input-len", "8",
                 "--output-len", "4", "--rounds", "1", "--dtype", "bfloat16",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["base alone", "base, adapters loaded", "base + 2 adapters mixed",
                          "one adapter every row"]
    assert all(rate > 0 for rate in rows.values())
