"""Prompt datasets: .jsonl/.parquet files or the built-in task -> templated ``Prompt`` records.

Field mappings (``DataConfig.format``):

========  =====================  ==================================================
format    prompt field           answer
========  =====================  ==================================================
gsm8k     question               ``answer`` after '####' (thousands commas removed)
math      problem                last ``\\boxed{...}`` of ``solution``
deepmath  question               final_answer
kodcode   question               test code (also kept in metadata with test_info)
custom    DataConfig.prompt_key  DataConfig.answer_key (dotted keys reach into dicts)
auto      guessed from the first row's keys
========  =====================  ==================================================

A custom prompt field may also hold a chat message list (veRL-style parquet), used as is.
Every bad row (bytes that are not UTF-8, invalid JSON, a missing or empty field, too long after
templating) stops loading with one error naming ``file:line`` (jsonl, 1-based) or ``file:row N``
(parquet, 0-based). Too long prompts may instead be dropped (``data.filter_overlong_prompts``):
counted, logged with examples, and refused when more than ``data.max_overlong_fraction`` of the
set would go.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from megatron_rl.config.schema import DataConfig
from megatron_rl.data import arithmetic
from megatron_rl.sample import Prompt

BUILTIN_SPLITS = {"builtin:arithmetic": "train", "builtin:arithmetic-test": "test"}
"""Built-in dataset names and the arithmetic split each one reads."""
BUILTIN_TASK_SEED = 0
"""Seed of the built-in problems. Fixed (not trainer.seed) so every run sees the same prompts."""
log = logging.getLogger(__name__)
FORMATS = ("auto", "gsm8k", "math", "deepmath", "kodcode", "custom", "builtin")


class DatasetError(ValueError):
    """A dataset row or file that cannot be turned into a prompt; the message names where."""


@dataclass
class RawExample:
    """One row after field mapping, before templating."""

    question: str | list[dict]
    """Question text, or a list of chat messages."""
    answer: str
    """Ground truth for the reward."""
    metadata: dict
    """Format-specific extras."""


# ---------------------------------------------------------------------------- chat template


def apply_chat_template(tokenizer: Any, question: str | list[dict], system_prompt: str = "") -> list[int]:
    """Token ids of ``question`` as a user turn (after an optional system turn), ending with the
    assistant header so generation starts the answer."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DatasetError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat_template")
    if isinstance(question, list):
        messages = list(question)
    else:
        messages = [{"role": "user", "content": question}]
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    # tokenize=False then encode: transformers 5 returns a BatchEncoding for tokenize=True, and
    # the template already contains the special tokens, so none may be added on top.
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------------- field mappings


def _field(row: dict, key: str) -> Any:
    """``row[key]``, where a dotted key walks into nested dicts; KeyError names the key."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def _text(row: dict, key: str) -> str:
    value = _field(row, key)
    if isinstance(value, bool) or value is None:
        raise ValueError(f"field {key!r} is {value!r}, expected text")
    if isinstance(value, (int, float)):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"field {key!r} has type {type(value).__name__}, expected text")
    if not value.strip():
        raise ValueError(f"field {key!r} is empty")
    return value


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
        i += 1
    return None  # unbalanced braces


def _map_gsm8k(row: dict, cfg: DataConfig) -> RawExample:
    solution = _text(row, "answer")
    if "####" not in solution:
        raise ValueError("field 'answer' has no '####' final answer")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise ValueError("field 'answer' is empty after '####'")
    return RawExample(_text(row, "question"), answer, {})


def _map_math(row: dict, cfg: DataConfig) -> RawExample:
    answer = last_boxed(_text(row, "solution"))
    if not answer:
        raise ValueError("field 'solution' has no complete \\boxed{...} answer")
    return RawExample(_text(row, "problem"), answer, {})


def _map_deepmath(row: dict, cfg: DataConfig) -> RawExample:
    return RawExample(_text(row, "question"), _text(row, "final_answer"), {})


def _map_kodcode(row: dict, cfg: DataConfig) -> RawExample:
    tests = _text(row, "test")
    metadata = {"tests": tests, "test_info": row.get("test_info")}
    return RawExample(_text(row, "question"), tests, metadata)


def _map_custom(row: dict, cfg: DataConfig) -> RawExample:
    if not cfg.prompt_key or not cfg.answer_key:
        raise DatasetError("format 'custom' needs data.prompt_key and data.answer_key")
    question = _field(row, cfg.prompt_key)
    if isinstance(question, list) and question and all(isinstance(m, dict) for m in question):
        # A ready-made message list (veRL-style 'prompt' column).
        bad = [m for m in question if not str(m.get("content", "")).strip()]
        if bad:
            raise ValueError(f"field {cfg.prompt_key!r} has a message with empty content")
    else:
        question = _text(row, cfg.prompt_key)
    return RawExample(question, _text(row, cfg.answer_key), {})


MAPPERS: dict[str, Callable[[dict, DataConfig], RawExample]] = {
    "gsm8k": _map_gsm8k,
    "math": _map_math,
    "deepmath": _map_deepmath,
    "kodcode": _map_kodcode,
    "custom": _map_custom,
}

# Checked in order: the first format whose keys are all present wins (kodcode and deepmath
# before gsm8k because they also have 'question').
_AUTO_KEYS = (
    ("kodcode", {"question", "test"}),
    ("deepmath", {"question", "final_answer"}),
    ("gsm8k", {"question", "answer"}),
    ("math", {"problem", "solution"}),
)


def guess_format(row: dict, where: str) -> str:
    """The format whose fields the row has; DatasetError listing the row's keys otherwise."""
    for name, keys in _AUTO_KEYS:
        if keys <= row.keys():
            return name
    expected = "; ".join(f"{n}: {sorted(k)}" for n, k in _AUTO_KEYS)
    raise DatasetError(
        f"{where}: cannot guess the dataset format from keys {sorted(row)}; expected one of "
        f"({expected}) or set data.format=custom with data.prompt_key/data.answer_key"
    )


# ---------------------------------------------------------------------------- file readers


def _read_jsonl(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(row index, 'file:line', parsed row) for each non-blank line."""
    row = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                # Decoded line by line so a bad byte is reported with its line; a UTF-8 BOM is fine.
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not valid UTF-8 (byte {raw[e.start:e.start + 1]!r} at column "
                                   f"{e.start + 1}); re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield row, where, record
            row += 1


def _read_parquet(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(row index, 'file:row N', row dict) for each row, read batch by batch."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
    row = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            yield row, f"{path}:row {row}", record
            row += 1


def read_rows(path: str | Path) -> Iterator[tuple[int, str, Any]]:
    """Rows of a .jsonl or .parquet file as (row index, location for errors, record)."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file not found: {p}")
    if p.suffix == ".jsonl":
        return _read_jsonl(p)
    if p.suffix == ".parquet":
        return _read_parquet(p)
    raise DatasetError(f"{p}: unsupported dataset file type {p.suffix!r} (expected .jsonl or .parquet)")


# ---------------------------------------------------------------------------- loading


class _Overlong:
    """Prompts over data.max_prompt_tokens: an error at the first one, or (with
    data.filter_overlong_prompts) dropped, counted, logged, and refused above a share."""

    _EXAMPLES = 3

    def __init__(self, source: str, cfg: DataConfig) -> None:
        self.source, self.cfg = source, cfg
        self.dropped: list[tuple[str, int]] = []

    def drops(self, where: str, num_tokens: int) -> bool:
        """Whether the prompt at ``where`` is dropped; raises when it is too long and not filtered."""
        if num_tokens <= self.cfg.max_prompt_tokens:
            return False
        if not self.cfg.filter_overlong_prompts:
            raise DatasetError(
                f"{where}: prompt is {num_tokens} tokens after the chat template, more than "
                f"data.max_prompt_tokens={self.cfg.max_prompt_tokens} (raise it, or set "
                "data.filter_overlong_prompts=true to drop such prompts)")
        self.dropped.append((where, num_tokens))
        return True

    def finish(self, kept: int) -> None:
        """Log what was dropped; refuse when more than data.max_overlong_fraction of the rows were."""
        if not self.dropped:
            return
        total = kept + len(self.dropped)
        share = len(self.dropped) / total
        examples = "; ".join(f"{where} ({n} tokens)" for where, n in self.dropped[:self._EXAMPLES])
        summary = (f"{self.source}: {len(self.dropped)} of {total} prompts ({share:.1%}) are longer than "
                   f"data.max_prompt_tokens={self.cfg.max_prompt_tokens} after the chat template, e.g. {examples}")
        if share > self.cfg.max_overlong_fraction:
            raise DatasetError(f"{summary}; that is more than data.max_overlong_fraction="
                               f"{self.cfg.max_overlong_fraction}: raise data.max_prompt_tokens (longest: "
                               f"{max(n for _, n in self.dropped)} tokens) or data.max_overlong_fraction")
        log.warning("%s: dropped them (data.filter_overlong_prompts=true)", summary)



def dataset_name(path: str | Path) -> str:
    """Id prefix for a file: '<parent dir>/<stem>', e.g. 'gsm8k/train' (stable across machines)."""
    p = Path(path)
    return f"{p.parent.name}/{p.stem}" if p.parent.name else p.stem


def load_file_prompts(
    path: str | Path,
    tokenizer: Any,
    fmt: str,
    cfg: DataConfig,
    limit: int | None = None,
) -> list[Prompt]:
    """Prompts of one .jsonl/.parquet file, ids '<dataset>:<row>'; at most ``limit`` rows."""
    if fmt not in MAPPERS and fmt != "auto":
        raise DatasetError(f"{path}: format {fmt!r} is not a file format; expected one of {sorted(MAPPERS) + ['auto']}")
    name = dataset_name(path)
    prompts: list[Prompt] = []
    overlong = _Overlong(str(path), cfg)
    for row, where, record in read_rows(path):
        if limit is not None and len(prompts) >= limit:
            break
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
        # 'auto' decides per row, so one file may mix shapes (e.g. DeepMath and KodCode rows for
        # a math+code run; reward.kind=mixed routes by the row's format).
        row_fmt = guess_format(record, where) if fmt == "auto" else fmt
        try:
            example = MAPPERS[row_fmt](record, cfg)
        except KeyError as e:
            raise DatasetError(f"{where}: missing field {e.args[0]!r} for format {row_fmt!r} "
                               f"(row keys: {sorted(record)})") from None
        except ValueError as e:
            raise DatasetError(f"{where}: {e}") from None
        token_ids = apply_chat_template(tokenizer, example.question, cfg.system_prompt)
        if overlong.drops(where, len(token_ids)):
            continue
        text = example.question if isinstance(example.question, str) else example.question[-1].get("content", "")
        prompts.append(
            Prompt(
                prompt_id=f"{name}:{row}",
                token_ids=token_ids,
                answer=example.answer,
                text=text,
                metadata={"format": row_fmt, **example.metadata},
            )
        )
    if not prompts and not overlong.dropped:
        raise DatasetError(f"{path}: no rows")
    overlong.finish(len(prompts))
    return prompts


def load_builtin_prompts(name: str, tokenizer: Any, cfg: DataConfig, count: int) -> list[Prompt]:
    """The first ``count`` problems of a built-in split, ids 'arith:<i>' / 'arith-test:<i>'."""
    split = BUILTIN_SPLITS[name]
    id_prefix = "arith" if split == "train" else "arith-test"
    prompts = []
    overlong = _Overlong(name, cfg)
    for problem in arithmetic.make_problems(count, seed=BUILTIN_TASK_SEED, split=split):
        token_ids = apply_chat_template(tokenizer, problem.question, cfg.system_prompt)
        if overlong.drops(f"{name}: problem {problem.index}", len(token_ids)):
            continue
        prompts.append(
            Prompt(
                prompt_id=f"{id_prefix}:{problem.index}",
                token_ids=token_ids,
                answer=problem.answer,
                text=problem.question,
                metadata={"format": "builtin", "num_steps": problem.num_steps},
            )
        )
    overlong.finish(len(prompts))
    return prompts


def load_prompts(cfg: DataConfig, tokenizer: Any, split: str = "train") -> list[Prompt]:
    """Prompts for training (``split='train'``: data.train_path) or validation (``'eval'``:
    data.eval_path, cut to the first data.eval_num_prompts; empty list when eval_path is '').

    Built-in names ('builtin:arithmetic', 'builtin:arithmetic-test') generate the task: the
    train set has data.builtin_num_prompts problems.
    """
    if split == "train":
        path, fmt, limit = cfg.train_path, cfg.format, None
    elif split == "eval":
        path, fmt, limit = cfg.eval_path, cfg.eval_format, cfg.eval_num_prompts
        if not path:
            return []
    else:
        raise ValueError(f"load_prompts split must be 'train' or 'eval', got {split!r}")
    if fmt not in FORMATS:
        raise DatasetError(f"unknown data format {fmt!r} for {path}; expected one of {FORMATS}")
    if path.startswith("builtin:"):
        if path not in BUILTIN_SPLITS:
            raise DatasetError(f"unknown built-in dataset {path!r}; expected one of {sorted(BUILTIN_SPLITS)}")
        if fmt not in ("auto", "builtin"):
            raise DatasetError(f"{path} is a built-in dataset; its format must be 'auto' or 'builtin', got {fmt!r}")
        count = cfg.builtin_num_prompts if limit is None else limit
        return load_builtin_prompts(path, tokenizer, cfg, count)
    if fmt == "builtin":
        raise DatasetError(f"format 'builtin' is only for builtin:* datasets, not the file {path}")
    return load_file_prompts(path, tokenizer, fmt, cfg, limit=limit)
