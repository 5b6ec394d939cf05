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


def echoed_logprobs(prompt_ids: list[int], positions: list | None, first_text: str,
                    generated: dict, as_ids: bool = False) -> dict:
    """An echoed completion's logprobs: the prompt's tokens first (the first with none, as
    OpenAI and vLLM send it; `positions`: the request's prompt logprobs), then `generated`
    (`completion_logprobs` of the new tokens, its offsets already past the prompt's text)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for i, token in enumerate(prompt_ids):
        position = positions[i] if positions is not None and i < len(positions) else None
        if position is None or token not in position:
            shown, text = (f"token_id:{token}" if as_ids else first_text), first_text
            token_logprobs.append(None)
            top.append(None)
        else:
            chosen = position[token]
            shown, text = _shown(token, chosen, as_ids), chosen.decoded_token or ""
            token_logprobs.append(finite(chosen.logprob))
            top.append({_shown(t, lp, as_ids): finite(lp.logprob) for t, lp in position.items()})
        tokens.append(shown)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens + generated["tokens"],
            "token_logprobs": token_logprobs + generated["token_logprobs"],
            "top_logprobs": top + generated["top_logprobs"],
            "text_offset": offsets + generated["text_offset"]}


def prompt_logprobs_field(positions: list | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the token and its alternatives."""
    if positions is None:
        return None
    return [None if p is None else {
        str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                 "decoded_token": lp.decoded_token} for t, lp in p.items()} for p in positions]
