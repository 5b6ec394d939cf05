"""lm-evaluation-harness against the server: its `local-completions` model (token ids, echo
with logprobs) on a small local multiple-choice task gives each choice the loglikelihood its
own Hugging Face backend computes on the same tiny model (within 1e-4), and the same
accuracy."""

import json

import pytest

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a dog"],
     "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five hundred", " blue"],
     "answer": 0},
    {"question": "Once upon a time there was a", "choices": [" princess", " tax form"],
     "answer": 1},
    {"question": "The quick brown fox jumps over the", "choices": [" lazy dog", " moon"],
     "answer": 0},
]
TASK = """task: tokenmill_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _loglikelihoods(model: str, model_args: str, folder) -> tuple[list, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args,
                                  tasks=["tokenmill_tiny_choice"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(folder)))
    samples = sorted(out["samples"]["tokenmill_tiny_choice"], key=lambda s: s["doc_id"])
    return ([[r[0] for r in s["resps"]] for s in samples],
            out["results"]["tokenmill_tiny_choice"]["acc,none"])


def test_local_completions_equal_the_hf_backend(server, tiny_models, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_models("llama")[0]
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    served, served_acc = _loglikelihoods(
        "local-completions", f"model=tiny,base_url={server}/v1/completions,tokenizer={path},"
        "tokenized_requests=True,max_retries=1", tmp_path)
    local, local_acc = _loglikelihoods("hf", f"pretrained={path},dtype=float32,device=cpu",
                                       tmp_path)
    assert len(served) == len(QUESTIONS)
    for got, want in zip(served, local):
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
    assert served_acc == local_acc
