"""OpenAI logprobs objects from a completion's per-token logprobs: completions' (tokens,
token_logprobs, top_logprobs, text_offset) and chat's (content of token, logprob, bytes,
top_logprobs). A token is shown as its text, or as `token_id:N` with vLLM's
`--return-tokens-as-token-ids` (tokens whose text is not valid alone, or that two ids share,
stay apart)."""

from __future__ import annotations

from tokenmill.outputs import CompletionOutput, Logprob


def finite(logprob: float) -> float:
    """A banned token's -inf as vLLM sends it: -9999.0 (JSON has no infinity)."""
    return max(logprob, -9999.0)


def _shown(token_id: int, lp: Logprob, as_ids: bool) -> str | None:
    return f"token_id:{token_id}" if as_ids else lp.decoded_token


def completion_logprobs(c: CompletionOutput, start: int, end: int, text_offset: int,
                        as_ids: bool = False) -> dict:
    """Tokens `start` .. `end` of `c`; `text_offset`: the first one's place in the text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token, position in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
        chosen = position[token]
        tokens.append(_shown(token, chosen, as_ids))
        token_logprobs.append(finite(chosen.logprob))
        top.append({_shown(t, lp, as_ids): finite(lp.logprob) for t, lp in position.items()})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token or "")  # (offsets into the text, as ids too)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, start: int, end: int, top_n: int,
                  as_ids: bool = False) -> dict:
    """Tokens `start` .. `end` of `c`, each with its `top_n` alternatives."""
    content = []
    for token, position in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank)[:top_n]
        content.append({**_entry(token, position[token], as_ids), "top_logprobs": [
            _entry(t, lp, as_ids) for t, lp in ranked]})
    return {"content": content}


def _entry(token_id: int, lp: Logprob, as_ids: bool) -> dict:
    shown = _shown(token_id, lp, as_ids)
    return {"token": shown, "logprob": finite(lp.logprob), "bytes": list((shown or "").encode())}
