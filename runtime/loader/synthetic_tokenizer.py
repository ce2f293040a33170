"""A synthetic byte-level tokenizer of a config's vocabulary size, for random-weight (`dummy`) models
whose folder has no tokenizer: built offline, cached under the cache dir, never in the model folder."""

from __future__ import annotations

import logging
import os
import random
import shutil
import string
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

VERSION = 1  # part of the cache key: bump it when the vocabulary below changes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(folder: Path) -> bool:
    """Whether `folder` holds tokenizer files (what `load_tokenizer` reads)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character (byte-level BPE's token
    text); the 188 printable bytes stand for themselves, the rest move to U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    moved = iter(range(256, 512))
    return {b: chr(b) if b in kept else chr(next(moved)) for b in range(256)}


def synthetic_tokenizer(
    vocab_size: int, bos_id: int | None, eos_ids: list[int]
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids, built offline (no merges: text
    encodes to its UTF-8 bytes, every id decodes): the config's EOS ids and BOS id as special
    tokens, all 256 bytes, then seeded pseudo-words, so that grammar masks walk a vocabulary of
    realistic shape. The same arguments give the same tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials: dict[int, str] = {}
    for i in eos_ids:
        if 0 <= i < vocab_size:
            specials[i] = "<|end_of_text|>" if not specials else f"<|special_{i}|>"
    if bos_id is not None and 0 <= bos_id < vocab_size and bos_id not in specials:
        specials[bos_id] = "<|begin_of_text|>"
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer")
    free = (i for i in range(vocab_size) if i not in specials)
    vocab = {s: i for i, s in specials.items()}
    for ch in byte_alphabet().values():
        vocab[ch] = next(free)
    rng = random.Random(0)
    for i in free:
        word = _pseudo_word(rng)
        while word in vocab:
            word += rng.choice(string.ascii_lowercase)
        vocab[word] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials.values()])
    eos = specials.get(eos_ids[0]) if eos_ids else None
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=specials.get(bos_id) if bos_id is not None else None,
        eos_token=eos,
        pad_token=eos,
    )


def cached_synthetic_tokenizer(
    cache_dir: Path, vocab_size: int, bos_id: int | None, eos_ids: list[int]
) -> Path:
    """The folder of `synthetic_tokenizer(vocab_size, bos_id, eos_ids)` under `cache_dir`, built
    once (in a temporary sibling, renamed into place when complete: processes that race both
    build it, and the loser uses the winner's)."""
    eos = "_".join(str(i) for i in eos_ids) or "none"
    name = f"byte-level-v{VERSION}-{vocab_size}-bos{bos_id}-eos{eos}"
    target = Path(cache_dir).expanduser().resolve() / "synthetic-tokenizers" / name
    if has_tokenizer(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=target.parent))
    try:
        synthetic_tokenizer(vocab_size, bos_id, eos_ids).save_pretrained(staging)
        try:
            os.replace(staging, target)  # atomic; fails if another process got there first
        except OSError:
            if not has_tokenizer(target):
                raise
        else:
            logger.info("built a synthetic tokenizer of %d ids in %s", vocab_size, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _pseudo_word(rng: random.Random) -> str:
    """A token string shaped like a real BPE vocabulary's: words, spaced words, digits, punctuation."""
    kind = rng.random()
    if kind < 0.08:
        return "".join(rng.choices(string.digits, k=rng.randint(1, 3)))
    if kind < 0.15:
        return "".join(rng.choices("{}[]\":,.-_()!?/'=*#", k=rng.randint(1, 3)))
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.choice([1, 2, 3, 4, 4, 5, 6, 7, 9])))
    if rng.random() < 0.15:
        word = word.capitalize()
    return ("Ġ" + word) if kind < 0.7 else word  # Ġ: a leading space in the byte alphabet
