"""Prompt datasets: every field mapping, chat template, bad rows with their location, builtins."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config.schema import DataConfig
from megatron_rl.data.datasets import (
    DatasetError,
    apply_chat_template,
    last_boxed,
    load_file_prompts,
    load_prompts,
)
from megatron_rl.model.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def user_turn(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_chat_template_tokens_and_system_prompt(tokenizer):
    ids = apply_chat_template(tokenizer, "Hi")
    assert tokenizer.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # Special tokens are single ids, bytes are one token each: 3 specials + 'user\n' + 'Hi' + '\n' + 'assistant\n'.
    assert len(ids) == 3 + 5 + 2 + 1 + 10
    with_system = apply_chat_template(tokenizer, "Hi", system_prompt="Be brief.")
    assert tokenizer.decode(with_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")


def test_gsm8k_format(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "gsm" / "train.jsonl",
        [
            {"question": "What is 2+2?", "answer": "2+2=<<2+2=4>>4\n#### 4"},
            {"question": "Big?", "answer": "so\n#### 1,080"},
        ],
    )
    prompts = load_file_prompts(path, tokenizer, "gsm8k", DataConfig())
    assert [p.prompt_id for p in prompts] == ["gsm/train:0", "gsm/train:1"]
    assert [p.answer for p in prompts] == ["4", "1080"]
    assert prompts[0].text == "What is 2+2?"
    assert prompts[0].token_ids == user_turn(tokenizer, "What is 2+2?")
    assert prompts[0].metadata == {"format": "gsm8k"}


def test_last_boxed_matches_braces():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{ {a}{b} }") == "{a}{b}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # unbalanced


def test_math_format(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "math.jsonl", [{"problem": "Half?", "solution": r"It is $\boxed{\frac{1}{2}}$."}])
    (prompt,) = load_file_prompts(path, tokenizer, "math", DataConfig())
    assert prompt.answer == r"\frac{1}{2}"
    assert prompt.text == "Half?"


def test_deepmath_format(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "dm.jsonl", [{"question": "Limit?", "final_answer": "0", "r1_solution_1": "..."}])
    (prompt,) = load_file_prompts(path, tokenizer, "auto", DataConfig())
    assert (prompt.answer, prompt.metadata["format"]) == ("0", "deepmath")


def test_kodcode_format_keeps_tests(tmp_path, tokenizer):
    row = {
        "question": "Write add(a, b).",
        "test": "from solution import add\ndef test_add():\n    assert add(1, 2) == 3\n",
        "test_info": [{"function_name": "add", "parameter_list": "(a, b)"}],
        "solution": "def add(a, b): return a + b",
    }
    path = write_jsonl(tmp_path / "kod.jsonl", [row])
    (prompt,) = load_file_prompts(path, tokenizer, "auto", DataConfig())
    assert prompt.metadata == {"format": "kodcode", "tests": row["test"], "test_info": row["test_info"]}
    assert prompt.answer == row["test"]


def test_auto_detects_each_row_so_math_and_code_can_mix(tmp_path, tokenizer):
    rows = [{"question": "Limit?", "final_answer": "0"},
            {"question": "Write f().", "test": "from solution import f\n", "test_info": []},
            {"question": "2+2?", "final_answer": "4"},
            {"input": "neither shape"}]
    path = write_jsonl(tmp_path / "mix.jsonl", rows[:3])
    prompts = load_file_prompts(path, tokenizer, "auto", DataConfig())
    assert [p.metadata["format"] for p in prompts] == ["deepmath", "kodcode", "deepmath"]
    bad = write_jsonl(tmp_path / "mixbad.jsonl", rows)
    with pytest.raises(DatasetError, match=r"mixbad\.jsonl:4: cannot guess"):
        load_file_prompts(bad, tokenizer, "auto", DataConfig())


def test_custom_format_with_dotted_key_and_messages(tmp_path, tokenizer):
    rows = [
        {"q": "Two?", "meta": {"gt": 2}},
        {"q": [{"role": "system", "content": "S"}, {"role": "user", "content": "Three?"}], "meta": {"gt": "3"}},
    ]
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    cfg = DataConfig(format="custom", prompt_key="q", answer_key="meta.gt", train_path=str(path), system_prompt="X")
    first, second = load_prompts(cfg, tokenizer)
    assert (first.answer, second.answer) == ("2", "3")  # numbers become text
    assert tokenizer.decode(first.token_ids).startswith("<|im_start|>system\nX<|im_end|>")
    # A row that brings its own system message keeps it (data.system_prompt is not added twice).
    assert tokenizer.decode(second.token_ids) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nThree?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert second.text == "Three?"


def test_custom_format_needs_keys(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", [{"q": "a", "a": "b"}])
    with pytest.raises(DatasetError, match="prompt_key"):
        load_prompts(DataConfig(format="custom", train_path=str(path)), tokenizer)


def test_auto_lists_keys_when_no_format_matches(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "x.jsonl", [{"input": "a", "output": "b"}])
    with pytest.raises(DatasetError, match=r"x\.jsonl:1: cannot guess.*\['input', 'output'\]"):
        load_prompts(DataConfig(train_path=str(path)), tokenizer)


@pytest.mark.parametrize(
    "bad_line, fmt, message",
    [
        ('{"question": "a", "answer": "#### 1"', "gsm8k", "invalid JSON"),
        ('{"question": "a"}', "gsm8k", "missing field 'answer'"),
        ('{"question": "   ", "answer": "#### 1"}', "gsm8k", "field 'question' is empty"),
        ('{"question": "a", "answer": "no marker"}', "gsm8k", "no '####'"),
        ('{"question": null, "answer": "#### 1"}', "gsm8k", "is None"),
        ('["a", "b"]', "gsm8k", "expected a JSON object"),
        ('{"problem": "a", "solution": "no box"}', "math", "no complete"),
        ('{"question": "' + "x" * 300 + '", "answer": "#### 1"}', "gsm8k", "more than data.max_prompt_tokens=256"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path, tokenizer, bad_line, fmt, message):
    good = '{"question": "q", "answer": "#### 1"}' if fmt == "gsm8k" else '{"problem": "q", "solution": "\\\\boxed{1}"}'
    # Blank line 2 is skipped but still counted: the bad row sits on line 4.
    path = write_jsonl(tmp_path / "bad.jsonl", [good, "", good, bad_line])
    with pytest.raises(DatasetError) as err:
        load_file_prompts(path, tokenizer, fmt, DataConfig())
    assert f"{path}:4:" in str(err.value)
    assert message in str(err.value)


def test_parquet_rows_and_bad_row(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d" / "train.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"problem": ["One?", "Two?"], "solution": [r"\boxed{1}", r"\boxed{2}"]}), path)
    prompts = load_prompts(DataConfig(train_path=str(path)), tokenizer)
    assert [(p.prompt_id, p.answer) for p in prompts] == [("d/train:0", "1"), ("d/train:1", "2")]

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["a", "b", "c"], "answer": ["#### 1", "#### 2", "none"]}), bad)
    with pytest.raises(DatasetError, match=rf"{bad}:row 2: field 'answer' has no '####'"):
        load_prompts(DataConfig(train_path=str(bad)), tokenizer)


def test_file_errors(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match="not found"):
        load_prompts(DataConfig(train_path=str(tmp_path / "missing.jsonl")), tokenizer)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported dataset file type '.csv'"):
        load_prompts(DataConfig(train_path=str(tmp_path / "d.csv")), tokenizer)
    write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DatasetError, match="no rows"):
        load_prompts(DataConfig(train_path=str(tmp_path / "empty.jsonl")), tokenizer)
    with pytest.raises(DatasetError, match="unknown data format 'gsm'"):
        load_prompts(DataConfig(train_path=str(tmp_path / "empty.jsonl"), format="gsm"), tokenizer)


def test_builtin_train_and_eval(tokenizer):
    cfg = DataConfig(builtin_num_prompts=100, eval_num_prompts=20)
    train = load_prompts(cfg, tokenizer, "train")
    evals = load_prompts(cfg, tokenizer, "eval")
    assert len(train) == 100 and len(evals) == 20
    assert train[3].prompt_id == "arith:3" and evals[3].prompt_id == "arith-test:3"
    assert train[0].token_ids == user_turn(tokenizer, train[0].text)
    assert train[0].text.startswith("Add the numbers: ")
    assert int(train[0].answer) == sum(int(t) for t in train[0].text.split(": ")[1].split(" + "))
    assert {p.text for p in train}.isdisjoint({p.text for p in evals})
    # Same prompts on every call (the task seed is fixed, not the run seed).
    assert [p.token_ids for p in load_prompts(cfg, tokenizer)] == [p.token_ids for p in train]
    assert load_prompts(DataConfig(eval_path=""), tokenizer, "eval") == []


def test_builtin_errors(tokenizer):
    with pytest.raises(DatasetError, match="unknown built-in dataset"):
        load_prompts(DataConfig(train_path="builtin:algebra"), tokenizer)
    with pytest.raises(DatasetError, match="format must be 'auto' or 'builtin'"):
        load_prompts(DataConfig(format="gsm8k"), tokenizer)
    with pytest.raises(DatasetError, match="max_prompt_tokens=40"):
        load_prompts(DataConfig(max_prompt_tokens=40, builtin_num_prompts=50), tokenizer)
    with pytest.raises(ValueError, match="split"):
        load_prompts(DataConfig(), tokenizer, "test")


def test_real_gsm8k(gsm8k_dir, tokenizer):
    cfg = DataConfig(train_path=str(gsm8k_dir / "test.jsonl"), eval_path=str(gsm8k_dir / "test.jsonl"), max_prompt_tokens=2048)
    prompts = load_prompts(cfg, tokenizer, "eval")
    assert len(prompts) == cfg.eval_num_prompts
    first = json.loads((gsm8k_dir / "test.jsonl").open().readline())
    assert prompts[0].prompt_id == "gsm8k/test:0"
    assert prompts[0].text == first["question"]
    assert prompts[0].answer == first["answer"].split("####")[-1].strip().replace(",", "")
    all_prompts = load_prompts(cfg, tokenizer, "train")
    assert len(all_prompts) == 1319
    assert all(p.answer.lstrip("-").replace(".", "").isdigit() for p in all_prompts)


def test_non_utf8_bytes_name_file_line_and_column(tmp_path, tokenizer):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"question": "q", "answer": "#### 1"}).encode()
    bad = '{"question": "caf\u00e9 price?", "answer": "#### 2"}'.encode("latin-1")
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + good + b"\n" + bad + b"\n")  # BOM on line 1 is fine
    with pytest.raises(DatasetError) as err:
        load_prompts(DataConfig(train_path=str(path)), tokenizer)
    assert f"{path}:3: not valid UTF-8" in str(err.value)
    column = bad.index(bytes([0xE9])) + 1
    assert f"column {column}" in str(err.value)
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n")
    assert [p.answer for p in load_prompts(DataConfig(train_path=str(path)), tokenizer)] == ["1"]


def _mixed_lengths(tmp_path, num_long: int, num_short: int = 20) -> Path:
    rows = [{"question": f"short {i}?", "answer": f"#### {i}"} for i in range(num_short)]
    for j in range(num_long):  # every 5th row is long, so long rows are spread through the file
        rows.insert(5 * j + 2, {"question": "long " + "y" * (300 + j), "answer": "#### 9"})
    return write_jsonl(tmp_path / "g" / "train.jsonl", rows)


def test_overlong_prompts_stop_loading_with_the_option_named(tmp_path, tokenizer):
    path = _mixed_lengths(tmp_path, num_long=2)
    with pytest.raises(DatasetError, match=rf"{path}:3: prompt is \d+ tokens .* data.filter_overlong_prompts=true"):
        load_prompts(DataConfig(train_path=str(path)), tokenizer)


def test_overlong_prompts_are_dropped_counted_and_logged(tmp_path, tokenizer, caplog):
    path = _mixed_lengths(tmp_path, num_long=2)
    cfg = DataConfig(train_path=str(path), eval_path=str(path), eval_num_prompts=4, filter_overlong_prompts=True)
    with caplog.at_level("WARNING"):
        train = load_prompts(cfg, tokenizer, "train")
    assert len(train) == 20 and all(len(p.token_ids) <= cfg.max_prompt_tokens for p in train)
    assert "g/train:2" not in {p.prompt_id for p in train} and train[2].prompt_id == "g/train:3"
    message = caplog.text
    assert "2 of 22 prompts (9.1%) are longer than data.max_prompt_tokens=256" in message
    assert f"{path}:3 (" in message and f"{path}:8 (" in message
    # Eval takes the first N prompts that fit (the share counts the rows read: 1 of 5 here).
    cfg.max_overlong_fraction = 0.25
    evals = load_prompts(cfg, tokenizer, "eval")
    assert [p.prompt_id for p in evals] == ["g/train:0", "g/train:1", "g/train:3", "g/train:4"]


def test_dropping_more_than_the_stated_share_is_refused(tmp_path, tokenizer):
    path = _mixed_lengths(tmp_path, num_long=4)  # 4 of 24 = 16.7% > 10%
    cfg = DataConfig(train_path=str(path), filter_overlong_prompts=True)
    with pytest.raises(DatasetError, match=r"4 of 24 prompts \(16.7%\).*more than data.max_overlong_fraction=0.1"):
        load_prompts(cfg, tokenizer)
    cfg.max_overlong_fraction = 0.2
    assert len(load_prompts(cfg, tokenizer)) == 20
    # The built-in task obeys the same rule.
    with pytest.raises(DatasetError, match="builtin:arithmetic: .* of 50 prompts"):
        load_prompts(DataConfig(max_prompt_tokens=60, builtin_num_prompts=50, filter_overlong_prompts=True), tokenizer)


def test_real_gsm8k_with_overlong_filter(gsm8k_dir, tokenizer):
    """The GSM8K train file has prompts over 256 byte-level tokens (row 3: 279): with the filter
    they are dropped and counted, and every kept prompt fits."""
    cfg = DataConfig(train_path=str(gsm8k_dir / "train.jsonl"), max_prompt_tokens=256)
    with pytest.raises(DatasetError, match=r"train.jsonl:3: prompt is 279 tokens"):
        load_prompts(cfg, tokenizer)
    cfg = DataConfig(train_path=str(gsm8k_dir / "train.jsonl"), max_prompt_tokens=512,
                     filter_overlong_prompts=True)
    kept = load_prompts(cfg, tokenizer)
    rows = sum(1 for line in (gsm8k_dir / "train.jsonl").open() if line.strip())
    assert 0.9 * rows < len(kept) < rows
    assert all(len(p.token_ids) <= 512 for p in kept)
