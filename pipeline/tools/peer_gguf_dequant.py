"""Dequantize a GGUF for the llama.cpp peer: `python peer_gguf_dequant.py SRC DST F32|BF16`.

Runs in the llama.cpp peer venv (with the `gguf` package), by path. Every tensor of SRC is
dequantized to float32, the way transformers read the same file into our HF folder, so the
two engines run the same weights; DST keeps them as F32, or as BF16 where llama.cpp allows
(matrices: norms and other 1-D tensors stay F32, as llama.cpp's own converter keeps them). All
metadata is copied, the file type updated."""

from __future__ import annotations

import sys

import gguf
import numpy as np

FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16}
ARCH_KEY = "general.architecture"
FILE_TYPE_KEY = "general.file_type"


def dequantize(src: str, dst: str, kind: str) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields[ARCH_KEY].contents()
    writer = gguf.GGUFWriter(dst, arch)  # it writes general.architecture itself
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (ARCH_KEY, FILE_TYPE_KEY):
            continue  # the header's own counts, rewritten by the writer
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(FILE_TYPES[kind])
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if kind == "BF16" and weights.ndim > 1:
            bf16 = gguf.GGMLQuantizationType.BF16
            writer.add_tensor(tensor.name, gguf.quants.quantize(weights, bf16), raw_dtype=bf16)
        else:
            writer.add_tensor(tensor.name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    dequantize(*sys.argv[1:])
