"""Response tokens to text for the reward worker, through the `tokenizers` library.

A reward worker only decodes. ``transformers.AutoTokenizer`` costs a worker ~4 CPU s at start
(loading it imports torch and sympy); the Rust ``tokenizers`` library that it wraps reads the
same ``tokenizer.json`` in ~0.02 s. transformers 5's fast-tokenizer decode is that library's decode
plus two settings from ``tokenizer_config.json``, both honoured here:

* which ids are special: the added tokens flagged special in ``tokenizer.json``, in the config's
  ``added_tokens_decoder``, and the config's named special tokens (``eos_token``, ``pad_token``,
  ..., ``additional_special_tokens``). ``skip_special_tokens=True`` drops exactly these, so they
  are filtered out here before decoding;
* ``clean_up_tokenization_spaces``: transformers ignores it for BPE models; for other models it
  changes the text, so such a tokenizer (or one without ``tokenizer.json``) is loaded through
  transformers instead (:func:`load_response_decoder` says which it took).

``tests/unit/test_response_decoder.py`` checks the decode equals ``AutoTokenizer``'s on every
token, on random sequences with special tokens among them, and on real text.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ResponseDecoder(Protocol):
    backend: str
    """'tokenizers' or 'transformers'."""

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` without special tokens."""


class TokenizersDecoder:
    """``tokenizer.json`` through the tokenizers library, special ids filtered first."""

    backend = "tokenizers"

    def __init__(self, tokenizer: Any, special_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self.special_ids = special_ids

    def decode(self, token_ids: list[int]) -> str:
        kept = [t for t in token_ids if t not in self.special_ids]
        return self._tokenizer.decode(kept, skip_special_tokens=False)


class TransformersDecoder:
    """``AutoTokenizer`` (tokenizers that :class:`TokenizersDecoder` cannot reproduce)."""

    backend = "transformers"

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(path)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


def _token_text(entry: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def special_token_ids(tokenizer: Any, config: dict) -> frozenset[int]:
    """Every id that transformers' ``skip_special_tokens=True`` drops (see the module docstring)."""
    ids = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, dict) and entry.get("special"):
            ids.add(int(key))
    named = [_token_text(config.get(k)) for k in _NAMED_SPECIAL]
    named += [_token_text(e) for e in config.get("additional_special_tokens") or []]
    named += [_token_text(e) for e in config.get("extra_special_tokens") or []]
    for text in filter(None, named):
        token_id = tokenizer.token_to_id(text)
        if token_id is not None:
            ids.add(token_id)
    return frozenset(ids)


def load_response_decoder(path: str) -> ResponseDecoder:
    """The decoder for the tokenizer in directory ``path`` (the policy's HF directory)."""
    directory = Path(path)
    tokenizer_file = directory / "tokenizer.json"
    config_file = directory / "tokenizer_config.json"
    if not tokenizer_file.is_file():
        return TransformersDecoder(path)
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"reward worker cannot read {config_file}: {exc}") from exc
    from tokenizers import Tokenizer, models

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises plain Exception subclasses for a bad file
        raise ValueError(f"reward worker cannot load {tokenizer_file}: {exc}") from exc
    if config.get("clean_up_tokenization_spaces") and not isinstance(tokenizer.model, models.BPE):
        return TransformersDecoder(path)
    return TokenizersDecoder(tokenizer, special_token_ids(tokenizer, config))
