"""The reward worker's decoder (megatron_rl/reward/pool/response_decoder.py) against transformers'
``AutoTokenizer.decode(..., skip_special_tokens=True)``, the decode it replaces."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from megatron_rl.reward.pool.response_decoder import load_response_decoder

TEXTS = [
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    "The answer is $\\boxed{\\frac{3}{4}}$ , so x = -0.75 .",
    "Ünïcödé: 价格是 12 元, émojis 🎉🚀 and tabs\tand  double  spaces ,.",
    "```python\ndef f(x):\n    return x ** 2\n```",
    " leading space and trailing newline\n",
]


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    cfg_file = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(config_changes)
    cfg_file.write_text(json.dumps(cfg))
    return dst


def _assert_same_decode(path: Path, sequences: list[list[int]]) -> None:
    reference = AutoTokenizer.from_pretrained(str(path))
    decoder = load_response_decoder(str(path))
    assert decoder.backend == "tokenizers"
    for ids in sequences:
        assert decoder.decode(ids) == reference.decode(ids, skip_special_tokens=True), ids


def _sequences(path: Path, texts: list[str], seed: int = 0) -> list[list[int]]:
    reference = AutoTokenizer.from_pretrained(str(path))
    vocab = len(reference)
    rng = random.Random(seed)
    special = sorted(reference.all_special_ids)
    sequences = [[i] for i in range(vocab)]  # every token alone
    sequences += [reference.encode(t, add_special_tokens=False) for t in texts]
    for _ in range(200):  # random ids with special tokens among them, as a sampled response has
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        for _ in range(rng.randrange(0, 4)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        sequences.append(ids)
    return sequences


def test_decode_equals_transformers_on_every_token_random_ids_and_real_text(tokenizer_dir):
    _assert_same_decode(tokenizer_dir, _sequences(tokenizer_dir, TEXTS))


def test_decode_equals_transformers_on_gsm8k_answers(tokenizer_dir, gsm8k_dir):
    rows = [json.loads(line) for line in (gsm8k_dir / "test.jsonl").read_text().splitlines()[:300]]
    texts = [r["question"] + "\n" + r["answer"] for r in rows]
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    eos = reference.convert_tokens_to_ids("<|im_end|>")
    _assert_same_decode(tokenizer_dir, [reference.encode(t, add_special_tokens=False) + [eos] for t in texts])


def test_tokens_made_special_by_the_config_are_dropped_like_transformers(tokenizer_dir, tmp_path):
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    plain = reference.convert_tokens_to_ids("a")
    path = _copy(tokenizer_dir, tmp_path / "tok", additional_special_tokens=["<|im_start|>"],
                 added_tokens_decoder={str(plain): {"content": "a", "special": True, "lstrip": False,
                                                     "rstrip": False, "normalized": False, "single_word": False}})
    decoder = load_response_decoder(str(path))
    assert plain in decoder.special_ids
    _assert_same_decode(path, _sequences(path, TEXTS, seed=1))


def test_bpe_ignores_clean_up_as_transformers_does(tokenizer_dir, tmp_path):
    path = _copy(tokenizer_dir, tmp_path / "tok", clean_up_tokenization_spaces=True)
    _assert_same_decode(path, _sequences(path, TEXTS, seed=2))


def test_a_wordpiece_tokenizer_with_clean_up_goes_through_transformers(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "hello", "world", ",", ".", "##s"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    tok.add_special_tokens(["[PAD]"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True, "pad_token": "[PAD]"}))
    decoder = load_response_decoder(str(tmp_path))
    assert decoder.backend == "transformers"
    ids = tok.encode("hello , worlds .").ids + [1]
    assert decoder.decode(ids) == "hello, worlds."
    assert tok.decode(ids) != decoder.decode(ids)  # the library alone would keep " ," and " ."


def test_a_directory_without_a_tokenizer_is_an_error_naming_it(tmp_path):
    from megatron_rl.config.schema import RewardConfig
    from megatron_rl.reward.pool.worker import RewardWorker

    with pytest.raises(ValueError, match=str(tmp_path)):
        RewardWorker(RewardConfig(), str(tmp_path), 64, eager_start=False)


def test_the_worker_module_and_decoder_load_without_torch(tokenizer_dir):
    code = ("import sys; from megatron_rl.reward.pool.worker import RewardWorker; "
            "from megatron_rl.reward.pool.response_decoder import load_response_decoder; "
            f"d = load_response_decoder({str(tokenizer_dir)!r}); assert d.backend == 'tokenizers'; "
            "print(sorted(m for m in ('torch', 'transformers', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
