"""Tasks: correct answers, seeded disjoint splits, ArithChain's long tail, countdown, data files."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from rollwise.rewards import countdown_verifier, final_number
from rollwise.tasks import TASKS, DatasetError, make_task, task_options
from rollwise.tasks.base import prompt_key


def _left_to_right(expression: str) -> tuple[int, list[int]]:
    """Independent evaluator: tokens 'a op b op c' evaluated left to right; (final, running)."""
    tokens = re.findall(r"\d+|[+\-*]", expression)
    acc, running = int(tokens[0]), []
    for op, number in zip(tokens[1::2], map(int, tokens[2::2])):
        acc = {"+": acc + number, "-": acc - number, "*": acc * number}[op]
        running.append(acc)
    return acc, running


@pytest.mark.parametrize("ops", ["+", "+-", "+-*"])
def test_arith_plain_answers_and_reference_grammar(ops: str) -> None:
    task = make_task("arith", seed=3, num_train=300, num_eval=50, terms=3, ops=ops)
    for sample in task.train + task.eval:
        assert isinstance(sample.prompt, str) and sample.prompt.endswith("=")
        numbers = re.findall(r"\d+", sample.prompt)
        assert len(numbers) == 3 and all(10 <= int(n) <= 99 for n in numbers)
        final, running = _left_to_right(sample.prompt[:-1])
        assert sample.answer == str(final)
        assert sample.reference == ";".join(map(str, running)) + f"#{final}"
        assert sample.meta == {"terms": 3, "digits": 2}
        assert final_number(sample.reference, sample) == 1.0
    if "-" in ops:  # negative results are allowed and happen
        assert any(int(s.answer) < 0 for s in task.train)


def test_arith_two_terms_reference_and_instruct_style() -> None:
    plain = make_task("arith", num_train=20, num_eval=5)
    sample = plain.train[0]
    a, b = map(int, sample.prompt[:-1].split("+"))
    assert sample.reference == f"{a + b}#{a + b}"

    chat = make_task("arith", chat=True, num_train=50, num_eval=5, ops="+-*", terms=2)
    for sample in chat.train:
        assert isinstance(sample.prompt, list) and sample.prompt[0]["role"] == "user"
        text = sample.prompt[0]["content"]
        match = re.fullmatch(
            r"What is (\d+) ([+\-*]) (\d+)\? Put the final answer after ####\.", text)
        assert match, text
        final, _ = _left_to_right(f"{match[1]}{match[2]}{match[3]}")
        assert sample.answer == str(final)
        assert sample.reference == f"{match[1]} {match[2]} {match[3]} = {final}\n#### {final}"


def test_left_to_right_without_precedence() -> None:
    task = make_task("arith", num_train=400, num_eval=10, terms=3, ops="+*", digits=1)
    both = [s for s in task.train if re.fullmatch(r"\d\+\d\*\d=", s.prompt)]
    assert both, "expected some a+b*c prompts"
    for sample in both:
        a, b, c = map(int, re.findall(r"\d", sample.prompt))
        assert int(sample.answer) == (a + b) * c


@pytest.mark.parametrize("name", ["arith", "arith_chain", "countdown"])
@pytest.mark.parametrize("chat", [False, True])
def test_split_is_disjoint_and_deterministic(name: str, chat: bool) -> None:
    task = make_task(name, seed=7, num_train=400, num_eval=60, chat=chat)
    again = make_task(name, seed=7, num_train=400, num_eval=60, chat=chat)
    other = make_task(name, seed=8, num_train=400, num_eval=60, chat=chat)
    assert (len(task.train), len(task.eval)) == (400, 60)
    train_texts = {prompt_key(s.prompt) for s in task.train}
    eval_texts = {prompt_key(s.prompt) for s in task.eval}
    assert not train_texts & eval_texts
    assert [s.prompt for s in task.train] == [s.prompt for s in again.train]
    assert [s.answer for s in task.eval] == [s.answer for s in again.eval]
    assert [s.prompt for s in task.train] != [s.prompt for s in other.train]
    assert task.train[5].id == f"{name}/train/5" and task.eval[0].id == f"{name}/eval/0"
    # The eval set does not depend on how many training prompts are asked for.
    bigger = make_task(name, seed=7, num_train=900, num_eval=60, chat=chat)
    assert [s.prompt for s in bigger.eval] == [s.prompt for s in task.eval]
    assert not {prompt_key(s.prompt) for s in bigger.train} & eval_texts
    assert [s.prompt for s in bigger.train[:400]] == [s.prompt for s in task.train]


def test_small_prompt_space_still_disjoint() -> None:
    # 1-digit a+b has only 100 distinct prompts: both splits repeat, but never cross.
    task = make_task("arith", num_train=500, num_eval=50, digits=1)
    train_texts = {s.prompt for s in task.train}
    eval_texts = {s.prompt for s in task.eval}
    assert len(task.train) == 500 and len(train_texts) < 100
    assert eval_texts and not train_texts & eval_texts


def test_arith_chain_is_heavy_tailed() -> None:
    task = make_task("arith_chain", seed=0, num_train=4000, num_eval=100)
    ks = [s.meta["terms"] for s in task.train]
    assert min(ks) == 2 and max(ks) <= 24
    frac_long = sum(k >= 8 for k in ks) / len(ks)
    assert 0.02 < frac_long < 0.25  # theory: 0.65**6 = 0.075
    assert abs(sum(k == 2 for k in ks) / len(ks) - 0.35) < 0.04  # P(k=2) = p
    assert sum(k == 24 for k in ks) <= 5  # P(k=24) ~ 8e-5
    lengths = sorted(len(s.reference) for s in task.train)
    top_decile = statistics.mean(lengths[-len(lengths) // 10 :])
    assert top_decile > 2.5 * statistics.median(lengths)
    for sample in task.train[:300]:
        numbers = list(map(int, sample.prompt[:-1].split("+")))
        assert len(numbers) == sample.meta["terms"] and all(0 <= n <= 9 for n in numbers)
        sums = [sum(numbers[: i + 1]) for i in range(1, len(numbers))]
        assert sample.reference == ";".join(map(str, sums)) + f"#{sum(numbers)}"


def test_arith_chain_options_and_chat() -> None:
    capped = make_task("arith_chain", num_train=500, num_eval=10, p=0.1, max_terms=6, digits=2)
    ks = [s.meta["terms"] for s in capped.train]
    assert max(ks) == 6 and sum(k == 6 for k in ks) > 200  # P(k=6) = 0.9**4 = 0.66
    chat = make_task("arith_chain", chat=True, num_train=20, num_eval=5)
    text = chat.train[0].prompt[0]["content"]
    assert text.startswith("What is ") and text.endswith("Put the final answer after ####.")
    assert chat.train[0].reference.endswith(f"#### {chat.train[0].answer}")


@pytest.mark.parametrize("chat", [False, True])
def test_countdown_instances_are_solvable(chat: bool) -> None:
    task = make_task("countdown", seed=1, num_train=300, num_eval=30, chat=chat)
    assert task.verifier is countdown_verifier
    for sample in task.train + task.eval:
        numbers = sample.meta["numbers"]
        assert 3 <= len(numbers) <= 4 and all(1 <= n <= 20 for n in numbers)
        assert 1 <= int(sample.answer) <= 500
        assert countdown_verifier(sample.reference, sample) == 1.0
        assert countdown_verifier(sample.meta["expression"], sample) == 1.0
        assert countdown_verifier(f"#### {sample.answer}", sample) == 0.0 or (
            int(sample.answer) in numbers
        )


def test_countdown_verifier_rejections() -> None:
    task = make_task("countdown", num_train=1, num_eval=1)
    sample = task.train[0]
    sample.meta["numbers"], sample.answer = [2, 3, 5, 7], "54"
    assert countdown_verifier("(3 + 5) * 7 - 2", sample) == 1.0
    assert countdown_verifier("reasoning...\n#### (3+5)*7-2 = 54", sample) == 1.0
    assert countdown_verifier("7 * 7 + 5", sample) == 0.0  # 7 used twice
    assert countdown_verifier("(3 + 5) * 7", sample) == 0.0  # 56, wrong target
    assert countdown_verifier("9 * 6", sample) == 0.0  # numbers not given
    assert countdown_verifier("__import__('os').system('true')", sample) == 0.0
    assert countdown_verifier("2 ** 3", sample) == 0.0
    assert countdown_verifier("7 / (5 - 5)", sample) == 0.0
    assert countdown_verifier("", sample) == 0.0


def test_unknown_task_and_option_suggest_close_names() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'arithh' \(did you mean 'arith'\?\)"):
        make_task("arithh")
    with pytest.raises(ValueError, match="did you mean 'digits'") as info:
        make_task("arith", digit=3)
    assert "ops" in str(info.value) and "terms" in str(info.value)
    with pytest.raises(ValueError, match="path"):
        make_task("arith", path="data.jsonl")
    with pytest.raises(ValueError, match=re.escape("ops='+/'")):
        make_task("arith", ops="+/")
    assert set(TASKS) == {"arith", "arith_chain", "arith_mix", "countdown", "file", "reasoning_gym",
                          "humaneval", "pycode", "verifiers",
                          "calc_tool", "lookup", "guess"}  # the last three: environments
    assert task_options("arith_chain") == {
        "p": 0.35, "max_terms": 24, "digits": 1, "ops": "+", "style": None,
    }


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3}
            for i in range(n)]


def test_file_task_from_jsonl(tmp_path) -> None:
    path = tmp_path / "data.jsonl"
    lines = [json.dumps(row) for row in _rows(50)]
    lines.insert(10, "   ")  # blank lines are skipped
    path.write_text("\n".join(lines) + "\n")
    task = make_task("file", path=str(path), num_train=100, num_eval=10, seed=2)
    assert (len(task.train), len(task.eval)) == (40, 10)
    assert not {s.prompt for s in task.train} & {s.prompt for s in task.eval}
    sample = task.eval[0]
    i = int(re.findall(r"\d+", sample.prompt)[0])
    assert sample.answer == str(2 * i) and sample.meta == {"level": i % 3}
    assert task.verifier(f"so #### {2 * i}", sample) == 1.0
    again = make_task("file", path=str(path), num_train=100, num_eval=10, seed=2)
    assert [s.prompt for s in again.eval] == [s.prompt for s in task.eval]
    chat = make_task("file", path=str(path), num_eval=10, chat=True, num_train=5)
    assert len(chat.train) == 5
    assert chat.train[0].prompt[0]["role"] == "user"


def test_file_task_from_parquet_and_eval_path(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows(30)
    messages = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]]
    pq.write_table(pa.Table.from_pylist(
        [{"question": r["prompt"], "solution": r["answer"]} for r in rows]), tmp_path / "t.parquet")
    shared = [{"role": "user", "content": rows[0]["prompt"]}]  # same text as train row 0
    pq.write_table(pa.Table.from_pylist([{"question": messages[0], "solution": "2"},
                                         {"question": shared, "solution": "0"}]),
                   tmp_path / "e.parquet")
    task = make_task("file", path=str(tmp_path / "t.parquet"),
                     eval_path=str(tmp_path / "e.parquet"),
                     prompt_key="question", answer_key="solution", verifier="math_verify")
    assert len(task.eval) == 2 and len(task.train) == 29  # the row shared with eval is dropped
    assert task.eval[0].prompt == messages[0]  # chat messages kept as they are
    assert task.verifier("#### 2", task.eval[0]) == 1.0


def test_file_task_from_datasets_directory(tmp_path) -> None:
    import datasets

    datasets.Dataset.from_list(_rows(25)).save_to_disk(str(tmp_path / "ds"))
    task = make_task("file", path=str(tmp_path / "ds"), num_eval=5)
    assert (len(task.train), len(task.eval)) == (20, 5)
    assert all(final_number(s.answer, s) == 1.0 for s in task.train)
    datasets.DatasetDict({"test": datasets.Dataset.from_list(_rows(8))}).save_to_disk(
        str(tmp_path / "dd"))
    assert len(make_task("file", path=str(tmp_path / "dd"), split="test", num_eval=2).train) == 6
    with pytest.raises(DatasetError, match="no split 'train'"):
        make_task("file", path=str(tmp_path / "dd"))


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"prompt": "x", "answer": ', "invalid JSON"),
        ('["prompt", "answer"]', "expected a JSON object, got list"),
        ('{"prompt": "x", "question": "y"}',
         "missing key 'answer' (keys present: prompt, question)"),
        ('{"prompt": 5, "answer": "1"}', "'prompt' must be a non-empty string or a list"),
        ('{"prompt": "x", "answer": null}', "'answer' must be a string or a number, got NoneType"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, line: str, expected: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n' + line + "\n")
    with pytest.raises(DatasetError) as info:
        make_task("file", path=str(path), num_eval=1)
    message = str(info.value)
    assert "data.jsonl:3: " in message and expected in message
    assert isinstance(info.value, ValueError)


def test_malformed_tables_and_paths(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"},
                                         {"prompt": "", "answer": "2"}]), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet: row 1: 'prompt' must be"):
        make_task("file", path=str(tmp_path / "bad.parquet"), num_eval=1)
    with pytest.raises(DatasetError, match=r"no column 'answerr' \(columns: prompt, answer\)"):
        make_task("file", path=str(tmp_path / "bad.parquet"), answer_key="answerr")
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unknown data format '.csv'"):
        make_task("file", path=str(tmp_path / "data.csv"))
    with pytest.raises(DatasetError, match="no such file"):
        make_task("file", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="too few"):
        (tmp_path / "tiny.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
        make_task("file", path=str(tmp_path / "tiny.jsonl"))
    with pytest.raises(ValueError, match="did you mean 'math_verify'"):
        make_task("file", path=str(tmp_path / "tiny.jsonl"), verifier="math_verfy", num_eval=0)


def test_arith_mix_draws_every_level_and_checks_them() -> None:
    task = make_task("arith_mix", seed=0, num_train=300, num_eval=60, levels=["1x3", "2x2"])
    levels = [(s.meta["digits"], s.meta["terms"]) for s in task.train]
    assert set(levels) == {(1, 3), (2, 2)} and 0.35 < levels.count((1, 3)) / 300 < 0.65
    for s in task.train[:20]:
        numbers = [int(x) for x in s.prompt[:-1].split("+")]
        assert len(numbers) == s.meta["terms"] and str(sum(numbers)) == s.answer
        assert task.verifier(s.reference, s) == 1.0
    with pytest.raises(ValueError, match="level '2y2'"):
        make_task("arith_mix", levels=["2y2"])
