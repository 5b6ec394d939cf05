"""OpenAI request schemas (pydantic), with vLLM's extra sampling fields, mapped to
SamplingParams. Unknown fields are ignored, as OpenAI-compatible servers do, except the known
ones this server does not implement (`UNSUPPORTED_FIELDS`), which are refused. Every field that
multiplies work (`n`, prompts, stop sequences, logprobs) is capped (`RequestCaps`), so one
small request cannot ask for unbounded work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from tokenmill.entrypoints.api.chat_content import template_content
from tokenmill.entrypoints.api.defaults import OPENAI
from tokenmill.entrypoints.parsers.tool_request import (
    MAX_TOOLS,
    ToolChoice,
    ToolDefinition,
    ToolPlan,
    plan_tools,
    template_messages,
)
from tokenmill.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams
from tokenmill.structured_output.response_format import from_response_format


@dataclass(frozen=True)
class RequestCaps:
    """Per-request caps of the HTTP and gRPC APIs (documented in docs/reliability.md)."""

    max_n: int = 16  # n and best_of
    max_prompts: int = 32  # prompts in one completions request
    max_sequences: int = 64  # prompts x n
    max_stop: int = 16  # stop sequences; also bad_words and stop_token_ids entries
    max_stop_chars: int = 256  # characters in one stop sequence or bad word
    max_logprobs: int = 20  # logprobs / top_logprobs
    max_logit_bias: int = 300  # logit_bias entries
    max_request_id_chars: int = 256  # the native API's req_id
    max_messages: int = 2048  # chat turns in one request
    max_content_parts: int = 256  # content parts of one chat message

    def word_list_problem(self, items: list) -> str | None:
        """What breaks the stop / bad-word caps in `items` (a phrase to follow the field's
        name), or None: for the routes that check their lists by hand (native, Triton); the
        OpenAI schema states the same caps."""
        if len(items) > self.max_stop:
            return f"may have at most {self.max_stop} entries, got {len(items)}"
        if any(isinstance(x, str) and len(x) > self.max_stop_chars for x in items):
            return f"may have at most {self.max_stop_chars} characters each"
        return None


CAPS = RequestCaps()
_StopText = Annotated[str, Field(min_length=1, max_length=CAPS.max_stop_chars)]
_TokenId = Annotated[int, Field(ge=0)]
# Keys a request may pass to the model's chat template; anything else (tokenize,
# add_generation_prompt, ...) would let a request change how the server renders or parses.
ALLOWED_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort"})


# Fields other OpenAI-compatible servers (vLLM, OpenAI itself) accept that this server does
# not implement. Ignoring them would return something the client did not ask for (output that
# breaks its grammar, a beam it did not search), so a request that sets one is refused with
# 400 naming it; null, false and empty values are accepted, as not asking.
UNSUPPORTED_FIELDS = {
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported (JSON comes out "
                                 "compact)",
    **dict.fromkeys(("functions", "function_call"), "the legacy functions API is not "
                    "supported (use tools and tool_choice)"),
    **dict.fromkeys(("audio", "modalities", "prompt_embeds", "mm_processor_kwargs"),
                    "this server takes text only"),
    "logits_processors": "custom logits processors are not supported",
    "truncate_prompt_tokens": "prompt truncation is not supported",
    "prediction": "predicted outputs are not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "continue_final_message": "continue_final_message is not supported",
    "documents": "documents are not supported",
    "vllm_xargs": "vllm_xargs is not supported",
    "lora_request": "a LoRA adapter is chosen by its name in `model` (--lora-modules); "
                    "this field is not supported",
}


def refuse_unsupported(body: dict) -> None:
    """Raises InvalidParameter for the first field of UNSUPPORTED_FIELDS the body sets."""
    for name, why in UNSUPPORTED_FIELDS.items():
        value = body.get(name)
        if value is not None and value is not False and value != [] and value != {} \
                and value != "":
            raise InvalidParameter(name, f"{name}: {why} by this server.")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = True
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    # strict: "10" is not an integer and true is not a temperature (OpenAI refuses both)
    model_config = ConfigDict(extra="ignore", strict=True)

    # Ranges and caps are part of the schema, so /openapi.json documents them.
    model: str | None = None
    n: int = Field(1, ge=1, le=CAPS.max_n)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    seed: int | None = None
    stop: _StopText | Annotated[list[_StopText], Field(max_length=CAPS.max_stop)] | None = None
    stop_token_ids: list[_TokenId] | None = Field(None, max_length=CAPS.max_stop)
    bad_words: list[_StopText] | None = Field(None, max_length=CAPS.max_stop)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: Annotated[list[_TokenId], Field(min_length=1)] | None = None  # vLLM's
    # vLLM's: each prompt token's logprob and this many alternatives (the first has none)
    prompt_logprobs: int | None = Field(None, ge=0, le=CAPS.max_logprobs)
    # vLLM's: lower runs first under --scheduling-policy priority
    priority: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's (config/kv_transfer.py)
    use_beam_search: bool = False  # vLLM's: `n` beams
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    user: str | None = None
    # structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    _constraint: tuple | None = PrivateAttr(None)

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint the request asks for and the field that asked (None, None),
        parsed once (each prompt's sampling params and the compile check share it)."""
        if self._constraint is None:
            self._constraint = self._parse_structured()
        return self._constraint

    def _parse_structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        asked: dict[str, dict | StructuredOutputsParams] = {}
        chosen = from_response_format(self.response_format)
        if chosen is not None:
            asked["response_format"] = chosen
        if (tools := self.tool_constraint()) is not None:
            asked["tools"] = tools
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked[name] = {kind: getattr(self, name)}
        if self.structured_outputs:
            if "after_token_ids" in self.structured_outputs:  # (set by the server only)
                raise InvalidParameter("structured_outputs", "structured_outputs takes json, "
                                       "json_object, regex, choice or grammar.")
            asked["structured_outputs"] = self.structured_outputs
        if self.guided_decoding_backend not in (None, "", "auto", "xgrammar"):
            raise InvalidParameter("guided_decoding_backend", "guided_decoding_backend must "
                                   "be auto or xgrammar.")
        if len(asked) > 1:
            raise InvalidParameter(list(asked)[1], "Give one structured-output constraint: "
                                   f"{' and '.join(asked)} were both set.")
        if not asked:
            return None, None
        name, spec = asked.popitem()
        if isinstance(spec, StructuredOutputsParams):
            return spec, name
        try:
            return StructuredOutputsParams(**spec), name
        except TypeError:
            raise InvalidParameter(name, f"{name} takes json, json_object, regex, choice or "
                                   "grammar.") from None
        except InvalidParameter as exc:
            raise InvalidParameter(name, f"{name}: {exc}") from None

    def tool_constraint(self) -> dict[str, Any] | None:
        """The constraint tool_choice `required` / a named function asks for (chat only)."""
        return None

    def slots(self) -> int:
        """Engine sequences this request asks for (what admission control counts)."""
        return self.n

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: dict | None = None) -> SamplingParams:
        """Unset knobs take `defaults` (the model's generation config: config/generation.py),
        else OpenAI's (api/defaults.py)."""
        d = defaults or {}
        return SamplingParams(
            n=self.n, temperature=_given(self.temperature, d, "temperature"),
            top_p=_given(self.top_p, d, "top_p"),
            top_k=_given(self.top_k, d, "top_k"),
            min_p=_given(self.min_p, d, "min_p"),
            repetition_penalty=_given(self.repetition_penalty, d, "repetition_penalty"),
            frequency_penalty=self.frequency_penalty or OPENAI["frequency_penalty"],
            presence_penalty=self.presence_penalty or OPENAI["presence_penalty"],
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            bad_words=self.bad_words,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): v for k, v in self.logit_bias.items()}
            if self.logit_bias else None, prompt_logprobs=self.prompt_logprobs,
            allowed_token_ids=self.allowed_token_ids,
            structured_outputs=self.structured()[0], kv_transfer_params=self.kv_transfer_params)

    def check(self) -> None:
        """Checks the schema (types, ranges, caps) cannot express; errors name the field."""
        if self.stream_options is not None and not self.stream:
            raise InvalidParameter("stream_options",
                                   "stream_options is only allowed when stream is true.")
        if self.logit_bias is not None and len(self.logit_bias) > CAPS.max_logit_bias:
            raise InvalidParameter("logit_bias", f"logit_bias may have at most "
                                   f"{CAPS.max_logit_bias} entries.")
        if self.logit_bias and not all(k.isascii() and k.isdigit() and len(k) <= 19
                                       for k in self.logit_bias):
            raise InvalidParameter("logit_bias", "logit_bias keys must be token ids.")


def _given(value, model_defaults: dict, name: str):
    """The request's value, else the model's generation config's, else OpenAI's default."""
    return value if value is not None else model_defaults.get(name, OPENAI[name])


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with echo: the prompt alone, scored (the loglikelihood request of lm-evaluation-harness)
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=CAPS.max_logprobs)
    best_of: int | None = Field(None, ge=1, le=CAPS.max_n)
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise InvalidParameter("suffix", "suffix is not supported by this server.")
        if self.kv_transfer_params and isinstance(self.prompt, list) and len(self.prompt) > 1 \
                and not isinstance(self.prompt[0], int):
            raise InvalidParameter("kv_transfer_params", "kv_transfer_params take one prompt.")
        if self.max_tokens == 0 and (not self.echo or self.stream or self.use_beam_search):
            raise InvalidParameter("max_tokens", "max_tokens 0 returns the prompt alone: it "
                                   "needs echo, without stream or beam search.")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidParameter("best_of", f"best_of ({self.best_of}) must be at least n "
                                   f"({self.n}).")
        if self.samples() > self.n and self.stream:
            raise InvalidParameter("best_of", "best_of greater than n cannot be streamed.")
        if self.samples() > self.n and self.use_beam_search:
            raise InvalidParameter("best_of", "best_of does not apply to beam search (n is "
                                   "the beam width).")
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidParameter("prompt", "prompt must not be empty.")
        num_prompts = len(self.prompts())
        if num_prompts > CAPS.max_prompts:
            raise InvalidParameter("prompt", f"at most {CAPS.max_prompts} prompts per request, "
                                             f"got {num_prompts}.")
        if num_prompts * self.samples() > CAPS.max_sequences:
            raise InvalidParameter("n", f"prompts x n (best_of) may be at most "
                                   f"{CAPS.max_sequences}, got {num_prompts} x "
                                   f"{self.samples()}.")

    def samples(self) -> int:
        """Sequences generated per prompt: best_of, of which the n best are returned."""
        return max(self.best_of or 1, self.n)

    def slots(self) -> int:
        return len(self.prompts()) * self.samples()

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: dict | None = None) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs, defaults)
        if self.echo and logprobs is not None:  # (the echoed prompt's tokens come scored)
            params = params.clone(prompt_logprobs=max(logprobs, params.prompt_logprobs or 0))
        if self.samples() > self.n:  # (ranked by cumulative logprob, which logprobs give)
            params = params.clone(n=self.samples(), logprobs=logprobs or 0)
        return params

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | Annotated[list[dict[str, Any]],
                             Field(max_length=CAPS.max_content_parts)] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=CAPS.max_messages)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=CAPS.max_logprobs)
    add_generation_prompt: bool = True
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    _tool_plan: ToolPlan | None = PrivateAttr(None)

    def plan_tools(self, has_parser: bool) -> ToolPlan | None:
        """What the request asks of tools (before its constraint is read)."""
        self._tool_plan = plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls,
                                     has_parser)
        return self._tool_plan

    def tool_constraint(self) -> dict[str, Any] | None:
        return None if self._tool_plan is None else self._tool_plan.constraint()

    def check(self) -> None:
        super().check()
        if self.echo:
            raise InvalidParameter("echo", "echo is not supported for chat completions.")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs requires logprobs to be true.")
        check_template_kwargs(self.chat_template_kwargs)

    def check_template(self, trust_request_template: bool) -> None:
        if self.chat_template is not None and not trust_request_template:
            raise InvalidParameter("chat_template", "A chat_template in the request is not "
                                   "accepted unless the server runs with "
                                   "--trust-request-chat-template.")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def plain_messages(self, images: list[str] | None = None) -> list[dict[str, Any]]:
        """Messages for the chat template; content parts of type text are joined. `images`
        (an image-text model): each `image_url` part's URL is appended to it, and its message
        keeps its parts, the image as `{"type": "image"}` where the template places it."""
        out = []
        for m in self.messages:
            message = m.model_dump(exclude_none=True)
            content = m.content
            if isinstance(content, list):
                message["content"] = template_content(content, images)
            elif content is None:
                message["content"] = ""
            out.append(message)
        return template_messages(out)



def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """Only allowlisted keys, with plain values, reach the chat template."""
    for key, value in (kwargs or {}).items():
        if key not in ALLOWED_TEMPLATE_KWARGS:
            raise InvalidParameter("chat_template_kwargs", f"chat_template_kwargs key {key!r} "
                                   "is not allowed; allowed: "
                                   f"{', '.join(sorted(ALLOWED_TEMPLATE_KWARGS))}.")
        if not isinstance(value, (str, bool, int, float, type(None))):
            raise InvalidParameter("chat_template_kwargs",
                                   f"chat_template_kwargs[{key!r}] must be a plain value.")


def openapi_body(model_cls: type[BaseModel]) -> dict[str, Any]:
    """The request body of a route, for `/openapi.json` (the handlers validate bodies
    themselves, so their errors are OpenAI's 400s, not FastAPI's 422s). Pydantic's local
    `$defs` references are inlined: they would not resolve inside the OpenAPI document."""
    schema = model_cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": inline(schema)}}}}
