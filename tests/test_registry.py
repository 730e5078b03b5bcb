"""The model registry (ipc/families/): every registered family resolves to a torch-free spec
reader and an executor module that builds it; every executor family module is registered;
families refused by name say what they lack, before anything starts."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ipc.arch import UnsupportedModel
from ipc.families import FAMILIES, REFUSED, family_of

ROOT = Path(__file__).resolve().parents[1]


def test_every_family_resolves_to_its_reader_and_builder() -> None:
    from stages.executor.models.base import CausalLM

    for model_type, family in FAMILIES.items():
        module, name = family.reader.split(":")
        assert callable(getattr(importlib.import_module(module), name)), model_type
        module, name = family.builder.split(":")
        assert issubclass(getattr(importlib.import_module(module), name), CausalLM), model_type


def test_every_executor_family_module_is_registered() -> None:
    built = {f.builder.split(":")[0].rpartition(".")[2] for f in FAMILIES.values()}
    shared = {"__init__", "base", "blocks", "moe_block"}
    modules = {p.stem for p in (ROOT / "stages/executor/models").glob("*.py")} - shared
    assert modules <= built, f"not in the registry: {sorted(modules - built)}"


def test_the_registry_reads_specs_without_torch() -> None:
    """The launcher refuses a model before any stage starts, without importing torch."""
    code = ("import sys, json; from ipc.families import FAMILIES, arch_spec\n"
            "from ipc.families.llama import llama_spec\n"
            "cfg = {'model_type': 'llama', 'hidden_size': 64, 'intermediate_size': 128,\n"
            "       'num_hidden_layers': 2, 'num_attention_heads': 4, 'vocab_size': 32}\n"
            "assert arch_spec(cfg).num_layers == 2\n"
            "for f in FAMILIES.values(): f.spec  # (readers import lazily)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_family_refused_by_name_says_what_it_lacks(model_type: str, tmp_path: Path) -> None:
    from ipc.model_info import ModelInfo

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    want = re.escape(f"model_type = '{model_type}': {REFUSED[model_type]}")
    with pytest.raises(UnsupportedModel, match=want):
        ModelInfo.from_dir(tmp_path)


def test_an_unknown_family_lists_those_the_engine_runs() -> None:
    with pytest.raises(UnsupportedModel, match="not implemented.*llama"):
        family_of({"model_type": "rwkv"}, "config.json")
