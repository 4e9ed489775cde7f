"""Pluggable embedding: an embedder is any callable taking a list of texts and returning one
vector (a sequence of floats) per text. The built-in default hashes word n-grams into a fixed
number of dimensions (the "hashing trick"), so the pipeline runs offline and reproducibly.

To use a real model, register a callable with `@app.embedder` or name one in the `embedder`
setting (MODULE:ATTR). It is called with at most `ingest_batch` texts at a time, from the worker
process, and must be deterministic enough that a redone batch gives equivalent vectors.
"""

from __future__ import annotations

import importlib
import math
import re
import zlib
from collections.abc import Callable, Sequence

from ..errors import ConfigError, LeaseworkError
from ..log import first_line

Vector = Sequence[float]
Embedder = Callable[[Sequence[str]], Sequence[Vector]]

_TOKEN = re.compile(r"\w+", re.UNICODE)


class EmbedError(LeaseworkError):
    """An embedder returned the wrong number of vectors, ragged or non-finite vectors."""


class HashingEmbedder:
    """Word unigrams and bigrams (lower-cased) hashed with CRC-32 into `dim` signed buckets,
    L2-normalised. Deterministic across processes and machines (no Python `hash()`)."""

    def __init__(self, dim: int = 256, ngrams: int = 2) -> None:
        if dim < 1 or ngrams < 1:
            raise ValueError("dim and ngrams must be >= 1")
        self.dim = dim
        self.ngrams = ngrams

    def __call__(self, texts: Sequence[str]) -> list[list[float]]:
        return [self.one(t) for t in texts]

    def one(self, text: str) -> list[float]:
        vec = [0.0] * self.dim
        tokens = _TOKEN.findall(text.lower())
        for n in range(1, self.ngrams + 1):
            for i in range(len(tokens) - n + 1):
                h = zlib.crc32(" ".join(tokens[i : i + n]).encode("utf-8"))
                vec[h % self.dim] += -1.0 if h & 0x80000000 else 1.0
        norm = math.sqrt(sum(x * x for x in vec))
        return [x / norm for x in vec] if norm else vec


def load_embedder(spec: str, where: str = "embedder") -> Embedder:
    """MODULE:ATTR of a callable (the `embedder` setting; `where` it was given, for the error).
    A module that fails to import, whatever it raises, is a ConfigError of one line."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # the user's module failing to import is a config error
        raise ConfigError(
            f"{where} {spec!r} cannot be loaded: {type(exc).__name__}: {first_line(exc)}"
        ) from None
    if not callable(obj):
        raise ConfigError(f"{where} {spec!r} is not callable")
    return obj


def embed_batch(embedder: Embedder, texts: Sequence[str]) -> list[list[float]]:
    """Call the embedder and check what it returned: one finite vector per text, one length."""
    vectors = [list(map(float, v)) for v in embedder(list(texts))]
    if len(vectors) != len(texts):
        raise EmbedError(f"embedder returned {len(vectors)} vectors for {len(texts)} texts")
    dims = {len(v) for v in vectors}
    if len(dims) > 1 or 0 in dims:
        raise EmbedError(f"embedder returned vectors of lengths {sorted(dims)}")
    if any(not math.isfinite(x) for v in vectors for x in v):
        raise EmbedError("embedder returned a non-finite number")
    return vectors
