"""Import: an artifact (a GGUF file, or a Hugging Face safetensors directory: hfdir.py) into
the store (checksum verified) and a new version into the registry; quantize: new variants
of a version made with llama.cpp's quantizer."""

from __future__ import annotations

import os
from pathlib import Path

from llmesh.errors import InvalidArgument
from llmesh.modelmgr.artifacts import ArtifactStore, Progress
from llmesh.modelmgr.gguf import describe, quantize
from llmesh.modelmgr.hfdir import DirLimits, import_directory, is_directory_source
from llmesh.modelmgr.registry import Artifact, Registry, Version, check_name


class Importer:
    def __init__(self, registry: Registry, store: ArtifactStore, dir_limits: DirLimits = DirLimits()):
        self._registry = registry
        self._store = store
        self._dir_limits = dir_limits

    def import_version(self, name: str, source: str, sha256: str = "", parent_version: int | None = None,
                       lineage: dict | None = None, progress: Progress | None = None) -> Version:
        check_name(name)
        if not source:
            raise InvalidArgument("name the artifact's source: a path, an http(s) URL or package:DIST",
                                  param="source")
        if is_directory_source(source):
            return self._import_directory(name, source, sha256, parent_version, lineage, progress)
        blob = self._store.import_source(source, sha256, progress)
        context_length, quant, tokenizer = 0, "", ""
        if blob.format == "gguf":
            info = describe(blob.path)
            context_length, quant, tokenizer = info.context_length, info.quantization, info.tokenizer
        artifact = Artifact(variant=quant or "default", format=blob.format, quantization=quant,
                            sha256=blob.sha256, size_bytes=blob.size_bytes)
        return self._registry.create_version(name, artifact, source=source, context_length=context_length,
                                             tokenizer=tokenizer, parent_version=parent_version, lineage=lineage)

    def _import_directory(self, name: str, source: str, sha256: str, parent_version: int | None,
                          lineage: dict | None, progress: Progress | None) -> Version:
        """A safetensors directory: one artifact, named by its manifest's digest."""
        d = import_directory(self._store, Path(source.removeprefix("file://")), sha256, progress, self._dir_limits)
        artifact = Artifact(variant=d.quantization or "default", format="safetensors", quantization=d.quantization,
                            sha256=d.sha256, size_bytes=d.size_bytes)
        return self._registry.create_version(name, artifact, source=source, context_length=d.context_length,
                                             tokenizer=d.tokenizer, parent_version=parent_version, lineage=lineage)

    def quantize(self, name: str, number: int, quantization: str, from_variant: str = "") -> Version:
        v = self._registry.get(name, number)
        src = v.artifact(from_variant) if from_variant else v.artifacts[0]
        if src.format != "gguf":
            raise InvalidArgument(f"{v.ref}'s {src.variant} is {src.format}; llama.cpp quantizes GGUF only",
                                  param="from_variant")
        if any(a.variant == quantization for a in v.artifacts):
            raise InvalidArgument(f"{v.ref} already has a {quantization} variant", param="quantization")
        out = self._store.root / "partial" / f"quantize-{os.getpid()}-{name}-{number}-{quantization}.gguf"
        out.parent.mkdir(parents=True, exist_ok=True)
        quantize(self._store.blob_path(src.sha256), out, quantization)
        blob = self._store.add_file(Path(out), out.name)
        info = describe(blob.path)
        return self._registry.add_artifact(name, number, Artifact(
            variant=quantization, format="gguf", quantization=info.quantization or quantization,
            sha256=blob.sha256, size_bytes=blob.size_bytes, derived_from=src.variant))
