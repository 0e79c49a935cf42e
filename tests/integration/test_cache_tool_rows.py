"""``skipinject cache show`` / ``diff`` / ``compact`` answer RL questions: each row's prompt, response,
score and response length (decoded by a tokenizer: the one given, else the recorded model's), how
many rows two steps share and each side's means, ratios and totals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from skipinject.cache_tool import main
from skipinject.store import StepStore
from skipinject.verl.codecs import DataProtoCodec
from tests.integration.test_cache_tool import LAYOUT, context, make_batch, write_dump

WORDS = ["<pad>", "<unk>", "what", "is", "two", "plus", "three", "five", "four", "answer"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny word-level tokenizer saved as a model directory (what ``--tokenizer`` takes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("model")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>").save_pretrained(path)
    return path


def ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


def rollout_batch(answers: list[str], scores: list[float], question: str = "what is two plus three") -> Any:
    """A GRPO-shaped DataProto: left-padded prompts, right-padded responses, rm_scores on the last token."""
    rows, prompt_width, response_width = len(answers), 5, 3
    batch = make_batch(rows, width=response_width)
    prompts = torch.zeros(rows, prompt_width, dtype=torch.int64)
    responses = torch.zeros(rows, response_width, dtype=torch.int64)
    attention = torch.zeros(rows, prompt_width + response_width, dtype=torch.int64)
    rm_scores = torch.zeros(rows, response_width)
    for row, answer in enumerate(answers):
        prompt, response = ids(*question.split()), ids(*answer.split())
        prompts[row, prompt_width - len(prompt) :] = torch.tensor(prompt)
        responses[row, : len(response)] = torch.tensor(response)
        attention[row, prompt_width - len(prompt) : prompt_width + len(response)] = 1
        rm_scores[row, len(response) - 1] = scores[row]
    batch.batch = batch.batch.select("rollout_log_probs")
    for key, value in {"prompts": prompts, "responses": responses, "attention_mask": attention}.items():
        batch.batch[key] = value
    batch.batch["rm_scores"] = rm_scores
    return batch


def save(
    root: Path, answers: list[str], scores: list[float], meta: dict[str, Any] | None = None, question: str = ""
) -> Path:
    store = StepStore(root / LAYOUT, "rollout", context())
    store.save(
        1, DataProtoCodec().encode(rollout_batch(answers, scores, question or "what is two plus three")), meta or {}
    )
    return store.step_dir(1)


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, Any, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if "--json" in argv else out, err


def test_show_lists_prompt_response_score_and_length_per_row(tmp_path: Path, tokenizer_dir: Path, capsys):
    step = save(tmp_path / "a", ["five", "four answer", "five"], [1.0, 0.0, 1.0])
    code, out, _ = run(capsys, "show", step)
    lines = out.splitlines()
    assert code == 0 and lines[-5].split() == ["ROW", "PROMPT", "RESPONSE", "SCORE", "LENGTH"]
    assert lines[-3].split()[-2:] == ["0", "2"] and "[8 9] (2 ids)" in lines[-3], "row 1: 'four answer'"
    assert "question 0-0" in lines[-3], "without a tokenizer, the chat prompt (raw_prompt) is shown"
    assert lines[-1] == "3 of 3 row(s) shown, token ids (--tokenizer decodes); mean score 0.6667, " \
        "mean response length 1.333"  # fmt: skip

    code, doc, _ = run(capsys, "show", step, "--tokenizer", tokenizer_dir, "--rows", "2", "--json")
    samples = doc["samples"]
    assert samples["rows"] == 3 and samples["tokenizer"] == str(tokenizer_dir)
    assert samples["first"][1] == {"row": 1, "prompt": "what is two plus three", "response": "four answer",
                                   "score": 0.0, "length": 2}  # fmt: skip

    recorded = save(tmp_path / "b", ["five"], [1.0], {"model": str(tokenizer_dir)})
    code, out, _ = run(capsys, "show", recorded)
    assert "  0  what is two plus three  five  " in out and f"decoded by {tokenizer_dir};" in out
    gone = save(tmp_path / "c", ["five"], [1.0], {"model": str(tmp_path / "deleted-model")})
    code, out, _ = run(capsys, "show", gone)
    assert code == 0 and "[7] (1 ids)" in out, "a recorded model that is not here: token ids"


def test_diff_counts_identical_rows_gives_each_sides_means_and_decodes_the_first_differing(
    tmp_path: Path, tokenizer_dir: Path, capsys
):
    a = save(tmp_path / "a", ["five", "five", "four", "five"], [1.0, 1.0, 0.0, 1.0])
    b = save(tmp_path / "b", ["five", "four answer", "four", "four"], [1.0, 0.0, 0.0, 0.0])
    code, out, _ = run(capsys, "diff", a, b, "--tokenizer", tokenizer_dir, "--rows", "1")
    assert code == 1
    assert "  rows: 2 of 4 identical (prompt and response)" in out
    assert (
        "  A: mean score 0.75, mean response length 1" in out
        and "  B: mean score 0.25, mean response length 1.25" in out
    )
    assert "  row 1: prompt what is two plus three\n    A: five (score 1, 1 tokens)\n" \
        "    B: four answer (score 0, 2 tokens)\n" in out  # fmt: skip
    assert "row 3:" not in out, "--rows 1"
    responses = next(line for line in out.splitlines() if line.startswith("batch.responses"))
    assert responses.split()[1:] == ["differs", "2/4", "-", "-"], "no |A-B| of token ids"
    code, doc, _ = run(capsys, "diff", a, b, "--json")
    samples = doc["steps"][0]["samples"]
    assert samples["identical"] == 2 and samples["a"]["mean_score"] == 0.75 and samples["tokenizer"] is None
    assert [pair["row"] for pair in samples["first_differing"]] == [
        1,
        3,
    ]
    code, out, _ = run(capsys, "diff", a, a)
    assert code == 0 and "rows: 4 of 4 identical" in out


def test_diff_shows_each_sides_prompt_where_they_differ(tmp_path: Path, tokenizer_dir: Path, capsys):
    a = save(tmp_path / "a", ["five"], [1.0])
    b = save(tmp_path / "b", ["four"], [0.0], question="what is two plus two")
    code, out, _ = run(capsys, "diff", a, b, "--tokenizer", tokenizer_dir)
    assert code == 1
    assert "  row 0: prompts differ\n    A prompt: what is two plus three\n    B prompt: what is two plus two\n" \
        "    A: five (score 1, 1 tokens)\n    B: four (score 0, 1 tokens)\n" in out, out  # fmt: skip


def test_show_match_names_the_files_columns_when_the_prompt_column_is_missing(tmp_path: Path, capsys):
    import pandas as pd

    write_dump(tmp_path / "dump")
    dataset = tmp_path / "train.parquet"
    pd.DataFrame({"question": ["a", "b"], "answer": ["1", "2"]}).to_parquet(dataset)
    code, _, err = run(capsys, "show", tmp_path / "dump", "--match", dataset)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{dataset}: no column 'prompt'; its columns: 'question', 'answer' (choose one with --column)" in err
    assert "__" not in err
