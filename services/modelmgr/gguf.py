"""GGUF files through llama.cpp (llama-cpp-python): what a file holds (context
length, quantization, tokenizer) and new quantized variants made from it with
llama.cpp's own quantizer (llama_model_quantize)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from llmesh.errors import Internal, InvalidArgument
from llmesh.modelstore import quiet_native_fd, quiet_native_stderr


def file_types() -> dict[str, int]:
    """llama.cpp's quantization names (Q8_0, Q4_K_M, ...) -> its LLAMA_FTYPE values."""
    import llama_cpp

    prefix = "LLAMA_FTYPE_MOSTLY_"
    types = {name.removeprefix(prefix): getattr(llama_cpp, name) for name in dir(llama_cpp)
             if name.startswith(prefix)}
    types["F32"] = getattr(llama_cpp, "LLAMA_FTYPE_ALL_F32", 0)
    return types


@dataclass(frozen=True, slots=True)
class GgufInfo:
    context_length: int
    quantization: str   # e.g. Q4_1; "" when the file does not say
    tokenizer: str      # e.g. gpt2 (the tokenizer model llama.cpp uses)
    architecture: str


def describe(path: Path) -> GgufInfo:
    """Reads the header and vocabulary only (~0.2 s); a file llama.cpp cannot read is
    INVALID_ARGUMENT (it would not load on an engine either)."""
    from llama_cpp import Llama

    try:
        with quiet_native_stderr():
            llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    except (ValueError, RuntimeError) as exc:
        raise InvalidArgument(f"{path.name}: llama.cpp cannot read it as GGUF ({exc})", param="source") from None
    try:
        meta = llm.metadata
        arch = meta.get("general.architecture", "")
        by_value = {v: k for k, v in file_types().items()}
        ftype = meta.get("general.file_type")
        quant = by_value.get(int(ftype), f"ftype-{ftype}") if ftype is not None else ""
        return GgufInfo(int(meta.get(f"{arch}.context_length", 0)), quant,
                        meta.get("tokenizer.ggml.model", ""), arch)
    finally:
        llm.close()


def quantize(src: Path, dst: Path, quantization: str, threads: int = 0) -> None:
    """Writes ``src`` re-quantized to ``quantization`` (Q8_0, Q4_0, ...) at ``dst``."""
    import llama_cpp

    types = file_types()
    if quantization not in types:
        raise InvalidArgument(f"unknown quantization {quantization!r}; llama.cpp knows {sorted(types)}",
                              param="quantization")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = types[quantization]
    params.allow_requantize = True  # the source may itself be quantized (SmolLM2 ships Q4_1)
    params.nthread = threads or (os.cpu_count() or 1)
    with quiet_native_stderr(), quiet_native_fd(1):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.is_file():
        dst.unlink(missing_ok=True)
        raise Internal(f"llama.cpp could not quantize {src.name} to {quantization} (code {rc})")
