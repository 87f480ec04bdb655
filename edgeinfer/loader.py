"""From a GGUF path to a checked model description: file + family + config.

Everything that can be wrong with a file is found here, before any weight is touched:
the GGUF structure (gguf_file), the architecture, the tensor types, the tensors the
family needs and their shapes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gguf import GGMLQuantizationType as T

from edgeinfer.errors import UnsupportedModelError
from edgeinfer.gguf_file import GGUFFile
from edgeinfer.models import ARCHITECTURES, ModelConfig, Transformer, family_for

# Tensor types the CPU backend computes on: the quant-type registry's GGML types
# (kernels_cpu.quant_types.supported_types(); tests/test_quant_types.py keeps them equal).
# Not imported from there: that package loads Numba, too much for a file rejected early.
SUPPORTED_TYPES = frozenset({
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4,
    T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
})


@dataclass(frozen=True)
class ModelFile:
    gguf: GGUFFile
    family: type[Transformer]
    config: ModelConfig


def open_model(path: str | os.PathLike[str]) -> ModelFile:
    gf = GGUFFile.open(path)
    arch = gf.architecture
    if not arch:
        raise UnsupportedModelError(f"{gf.path}: no general.architecture key; is this a model file?")
    family = family_for(arch)
    if family is None:
        known = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModelError(f"{gf.path}: architecture {arch!r} is not supported (supported: {known})")
    for info in gf.tensors.values():
        if info.qtype not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{gf.path}: tensor {info.name!r} has type {info.qtype.name}, which edgeinfer cannot run yet")
    config = family.read_config(gf)
    family.validate(config, gf)
    return ModelFile(gf, family, config)
