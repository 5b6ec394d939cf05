"""Requests of a pooling model's routes (pydantic, OpenAI's and vLLM's shapes): embeddings
(`/v1/embeddings`, `/pooling`), classification (`/classify`), scores (`/score`,
`/v1/score`) and reranking (`/rerank`, `/v1/rerank`, `/v2/rerank`: Cohere's and Jina's
shape). Every list is capped before any text is tokenized."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.pooling_params import PoolingParams

MAX_INPUTS = 2048  # texts (or token-id lists) in one request: OpenAI's embeddings limit
MAX_DOCUMENTS = 1000  # documents to rerank, pairs to score
_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Input = _Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_INPUTS)] | _Ids | \
    Annotated[list[_Ids], Field(min_length=1, max_length=MAX_INPUTS)]


class _PoolingFields(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    user: str | None = None
    priority: int = 0  # (vLLM's: lower runs first under --scheduling-policy priority)
    # vLLM's: tokenize with the model's special tokens (BOS / EOS as its tokenizer adds them)
    add_special_tokens: bool = True


class EmbeddingRequest(_PoolingFields):
    """OpenAI's embeddings request, with vLLM's `normalize`. `input`: a text, texts, token
    ids, or lists of token ids."""

    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(task="embed", dimensions=self.dimensions, normalize=self.normalize)


class PoolingRequest(EmbeddingRequest):
    """vLLM's `/pooling`: the model's own task (an embedding, or a classifier's scores)."""

    task: Literal["embed", "classify"] | None = None


class ClassificationRequest(_PoolingFields):
    input: Input


class ScoreRequest(_PoolingFields):
    """vLLM's `/score`: `text_1` against each `text_2` (one to many), or pairwise. (vLLM's
    newer `queries` / `documents` spelling is taken too.)"""

    text_1: _Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_DOCUMENTS)] | \
        None = None
    text_2: _Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_DOCUMENTS)] | \
        None = None
    queries: _Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_DOCUMENTS)] | \
        None = None
    documents: _Text | Annotated[list[_Text], Field(min_length=1,
                                                    max_length=MAX_DOCUMENTS)] | None = None

    def texts(self) -> tuple[str | list[str], str | list[str]]:
        first = self.text_1 if self.text_1 is not None else self.queries
        second = self.text_2 if self.text_2 is not None else self.documents
        if first is None or second is None:
            raise ValueError("A score needs text_1 and text_2 (or queries and documents).")
        return first, second


class _Document(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    text: _Text


class RerankRequest(_PoolingFields):
    """Cohere's and Jina's rerank: `documents` (texts, or objects with `text`) ordered by
    relevance to `query`; the best `top_n` (default: all)."""

    query: _Text
    documents: Annotated[list[_Text | _Document], Field(min_length=1,
                                                        max_length=MAX_DOCUMENTS)]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]
