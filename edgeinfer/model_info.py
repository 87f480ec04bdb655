"""What `edgeinfer show` (and the REST `/api/show`) reports about a model file."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from edgeinfer.gguf_split import parse_part_name
from edgeinfer.loader import ModelFile
from edgeinfer.metadata import meta_int, meta_str
from edgeinfer.units import human_bytes, human_count  # noqa: F401 - re-exported for show/bench

# llama.cpp's `general.file_type` (LLAMA_FTYPE_*) names, for the ones users meet.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS",
    24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
    32: "BF16", 38: "MXFP4_MOE",
}


@dataclass
class ModelInfo:
    path: str
    architecture: str
    name: str
    parameters: int
    context_length: int
    embedding_length: int
    block_count: int
    head_count: int
    head_count_kv: int | list[int]  # one per layer where they differ (gemma4 26B-A4B, 31B)
    quantization: str
    tensor_types: dict[str, int]
    file_size: int
    has_chat_template: bool
    license: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def describe(mf: ModelFile) -> ModelInfo:
    gf, cfg, md = mf.gguf, mf.config, mf.gguf.metadata
    ftype = meta_int(md, "general.file_type", 0, (1 << 32) - 1, None)
    quant = FILE_TYPES.get(ftype, f"file type {ftype}") if ftype is not None else next(iter(gf.type_counts()), "?")
    return ModelInfo(
        path=str(gf.path),
        architecture=cfg.arch,
        name=meta_str(md, "general.name", "") or _stem(gf.path.name),
        parameters=gf.parameter_count(),
        context_length=cfg.n_ctx_train,
        embedding_length=cfg.n_embd,
        block_count=cfg.n_layer,
        head_count=cfg.n_head,
        head_count_kv=list(cfg.n_head_kv_layers) if cfg.n_head_kv_layers else cfg.n_head_kv,
        quantization=quant,
        tensor_types=gf.type_counts(),
        file_size=gf.file_size,
        has_chat_template=bool(meta_str(md, "tokenizer.chat_template", "")),
        license=meta_str(md, "general.license", None),
    )


def _stem(filename: str) -> str:
    """A file's model name: its name without `.gguf`, and without a split part's `-0000N-of-0000M`."""
    part = parse_part_name(filename)
    return part[0] if part is not None else filename.removesuffix(".gguf")
