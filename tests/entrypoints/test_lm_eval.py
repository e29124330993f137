"""lm-eval-harness's local-completions model against tpengine serve, on a multiple-choice task defined here from a
local JSON file (nothing downloaded): each choice's loglikelihood equals lm-eval's own hf model's on the same
checkpoint, and the choices sharing a context share its scored blocks, so the run computes at most half of its
prompt tokens."""
import json

import pytest

from tests.entrypoints.conftest import BLOCK_SIZE

TASK = "tpengine_tiny_choice"
TOLERANCE = 1e-4
# contexts of several blocks each (the byte tokenizer: a token per character), choices of a few tokens: lm-eval
# scores context + " " + choice for every choice, one request each
DOCS = [{"context": f"Question {i}: which word best completes this sentence about tensor parallel inference, "
                    f"as the {i}th example of a tiny local task? Answer:",
         "choices": ["shards", "blocks", "the cache", "none of them"], "label": i % 4} for i in range(3)]


def write_task(folder) -> None:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {folder / "datasets-cache"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")


def loglikelihoods(model: str, model_args: str, folder) -> dict[int, list[float]]:
    """Each document's choices' loglikelihoods, as lm-eval logs its samples."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    tasks = TaskManager(include_path=str(folder), include_defaults=False)  # not lm-eval's thousands of tasks
    # seeds None: the suite's process keeps its random states (a zero-shot task draws nothing)
    results = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], device="cpu", log_samples=True,
                              bootstrap_iters=0, task_manager=tasks, random_seed=None, numpy_random_seed=None,
                              torch_random_seed=None)
    return {sample["doc_id"]: [loglikelihood for loglikelihood, _ in sample["filtered_resps"]]
            for sample in results["samples"][TASK]}


def computed_and_total_prompt_tokens(server) -> tuple[float, float]:
    total = server.metric("tpengine:prompt_tokens_total", model_name="tiny")
    return total - server.metric("tpengine:prefix_cache_hits_total", model_name="tiny"), total


def test_lm_eval_local_completions_equal_its_hf_model_and_share_scored_contexts(server, tied_model, tmp_path,
                                                                                monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_task(tmp_path)
    assert len(DOCS[0]["context"]) > 6 * BLOCK_SIZE
    computed_before, total_before = computed_and_total_prompt_tokens(server)
    served = loglikelihoods("local-completions", f"base_url={server.url}/v1/completions,model=tiny,"
                            f"tokenizer={tied_model},tokenizer_backend=huggingface,tokenized_requests=True", tmp_path)
    computed_after, total_after = computed_and_total_prompt_tokens(server)
    reference = loglikelihoods("hf", f"pretrained={tied_model},dtype=float32", tmp_path)
    assert served.keys() == reference.keys() == set(range(len(DOCS)))
    for doc_id, values in served.items():
        assert values == pytest.approx(reference[doc_id], abs=TOLERANCE)
    # a server without the cache computes every prompt token (the whole count): this one, at most half of them
    assert computed_after - computed_before <= (total_after - total_before) / 2
