"""GGUF file -> cached HF-format folder (config, tokenizer, generation config, fp32 safetensors)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from weft.runtime.loader.gguf_header import CorruptGGUFError, GGUFHeader, read_gguf_header
from weft.runtime.loader.gguf_weights import check_supported, write_safetensors

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SOURCE_FILE = "weft_gguf_source.json"  # provenance: which GGUF (path, sha256) the folder came from


def file_sha256(path: Path, chunk_bytes: int = 8 << 20) -> str:
    """Hex sha256 of a file, streamed."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def converted_folder(cache_dir: Path, sha256: str, weights: bool = True) -> Path:
    return cache_dir / (f"gguf-{sha256[:16]}" if weights else f"gguf-{sha256[:16]}-meta")


def convert_gguf(
    gguf_path: Path, cache_dir: Path, expected_sha256: str | None = None, weights: bool = True
) -> Path:
    """Return the HF folder converted from `gguf_path`, converting it once into `cache_dir`.
    Without `weights` the folder holds only config, tokenizer and generation config (a model
    that keeps the file's blocks reads its tensors from the file itself); a complete folder of
    the same file serves that too.

    The folder is keyed by the file's sha256, built in a temporary sibling and renamed into place
    when complete. Processes converting the same file wait for each other on a lock file; if two
    still race (hosts sharing a network filesystem), the loser discards its copy and uses the
    winner's.
    Raises CorruptGGUFError for an unreadable file (or one whose sha256 differs from
    `expected_sha256`) and ValueError for an architecture we cannot convert.
    """
    gguf_path, cache_dir = gguf_path.resolve(), cache_dir.expanduser().resolve()
    sha256 = file_sha256(gguf_path)
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise CorruptGGUFError(
            f"{gguf_path} is damaged: its sha256 {sha256[:16]}... differs from the "
            f"{expected_sha256[:16]}... recorded when it was installed"
        )
    target = converted_folder(cache_dir, sha256, weights)
    for folder in (target, converted_folder(cache_dir, sha256)):
        if _is_complete(folder):
            logger.debug("reusing %s for %s", folder, gguf_path)
            return folder

    header = read_gguf_header(gguf_path)
    check_supported(header)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target):
        if _is_complete(target):  # converted by the process we waited for
            return target
        if target.exists():
            logger.warning("removing incomplete converted folder %s", target)
            shutil.rmtree(target, ignore_errors=True)
        _remove_abandoned(target)
        _convert_into(header, sha256, target, weights)
    return target


##### Internal Helper Functions #####


def _convert_into(header: GGUFHeader, sha256: str, target: Path, weights: bool) -> None:
    owner = f"{socket.gethostname()}-{os.getpid()}-"
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{owner}", dir=target.parent))
    try:
        logger.info("converting %s into %s (done once, then cached)", header.path, target)
        start = time.perf_counter()
        _write_folder(header, sha256, staging, weights)
        if _publish(staging, target):
            logger.info("converted %s in %.1f s", header.path.name, time.perf_counter() - start)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """Let one process at a time convert a given file (e.g. all ranks of a TP group at start).

    NOTE: only saves duplicate work; correctness rests on the atomic rename in _publish (flock
    may not hold across hosts on a network filesystem).
    """
    with open(target.parent / f".{target.name}.lock", "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting into %s", target)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _is_complete(folder: Path) -> bool:
    """A published folder is complete by construction; this guards against later tampering."""
    return (folder / SOURCE_FILE).is_file() and (folder / "config.json").is_file()


def _remove_abandoned(target: Path) -> None:
    """Delete staging folders of `target` left by converters on this host that have died."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.partial-(?P<host>.+)-(?P<pid>\d+)-\w+")
    for path in target.parent.glob(f".{target.name}.partial-*"):
        match = pattern.fullmatch(path.name)
        if match and match["host"] == socket.gethostname() and not _alive(int(match["pid"])):
            logger.info("removing %s, left by a converter that died", path)
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _publish(staging: Path, target: Path) -> bool:
    """Move the finished folder into place; False if another process got there first."""
    try:
        os.replace(staging, target)  # atomic; fails if another process already published
    except OSError:
        if not _is_complete(target):
            raise
        logger.info("another process converted %s first; using its folder", target.name)
        return False
    return True


def _write_folder(header: GGUFHeader, sha256: str, folder: Path, weights: bool) -> None:
    """Everything but the provenance file first, so the folder is complete when that appears."""
    if not weights:
        _write_config_and_tokenizer(header, folder)
        n_params = sum(t.numel for t in header.tensors)
        source = {"gguf": str(header.path), "sha256": sha256, "parameters": n_params}
        (folder / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        return
    # The weights are numpy work that mostly releases the GIL: overlap them with transformers'
    # config and tokenizer parsing, which is pure Python.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gguf-weights") as pool:
        written = pool.submit(_write_weights, header, folder)
        _write_config_and_tokenizer(header, folder)
        n_params = written.result()
    source = {"gguf": str(header.path), "sha256": sha256, "parameters": n_params}
    (folder / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def _write_weights(header: GGUFHeader, folder: Path) -> int:
    start = time.perf_counter()
    n_params = write_safetensors(header, folder)
    logger.info(
        "dequantized %d tensors (%.1fM parameters) to fp32 in %.1f s",
        len(header.tensors),
        n_params / 1e6,
        time.perf_counter() - start,
    )
    return n_params


def _write_config_and_tokenizer(header: GGUFHeader, folder: Path) -> None:
    import torch
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    start = time.perf_counter()
    src, name = str(header.path.parent), header.path.name
    config = AutoConfig.from_pretrained(src, gguf_file=name, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    if not getattr(config, "architectures", None):
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    tied = all(t.name != "output.weight" for t in header.tensors)
    assert config.tie_word_embeddings == tied, (config.tie_word_embeddings, tied)
    if header.architecture == "gemma3":
        gemma3_config(config, header)
    config.save_pretrained(folder)

    tokenizer = _tokenizer_class(config).from_pretrained(src, gguf_file=name, local_files_only=True)
    meta = header.metadata
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if header.architecture == "gemma3":
        eos = gemma3_chat(tokenizer, eos)
    tokenizer.save_pretrained(folder)
    if "tokenizer.chat_template" in header.metadata and not _has_chat_template(folder):
        raise ValueError(f"{header.path}: the chat template was lost converting the tokenizer")

    GenerationConfig(
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    ).save_pretrained(folder)
    logger.info("config and tokenizer from GGUF metadata in %.1f s", time.perf_counter() - start)


def gemma3_config(config: PretrainedConfig, header: GGUFHeader) -> None:
    """What a gemma3 GGUF does not hold, as llama.cpp assumes it (transformers' GGUF config
    already has Gemma 3's published defaults: a global layer every 6th, local rope base 10000):
    the attention scale from head_dim (hidden / heads for the 62-layer 27B), and the global
    layers' linear rope scaling (4B and up)."""
    heads, layers = int(config.num_attention_heads), int(config.num_hidden_layers)
    head_dim = int(header.arch_value("attention.key_length", config.head_dim))
    config.head_dim = head_dim
    config.query_pre_attn_scalar = config.hidden_size // heads if layers == 62 else head_dim
    kind, factor = header.arch_value("rope.scaling.type"), header.arch_value("rope.scaling.factor")
    if kind not in (None, "none") and factor not in (None, 1.0):
        if kind != "linear":
            raise ValueError(f"{header.path}: gemma3 rope scaling {kind!r} is not supported")
        config.rope_parameters["full_attention"].update(rope_type="linear", factor=float(factor))


# Gemma's chat format (Google's Gemma 3 template, text parts only): a system prompt folded into the
# first user turn, the assistant named "model", BOS at the start
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""


def gemma3_chat(tokenizer: PreTrainedTokenizerBase, eos: int | None) -> int | list[int] | None:
    """The chat-template fallback for Gemma 3: a gemma3 GGUF without a template of its own (the
    base models) gets GEMMA_CHAT_TEMPLATE, written with the tokenizer into the converted folder,
    so every consumer of the folder's tokenizer (the server's chat routes, the DSL's chat roles)
    renders Gemma's turns. Returns the generation config's EOS ids: the file's plus
    <end_of_turn>, where a turn ends (llama.cpp stops there too)."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if not isinstance(end, int) or end == tokenizer.unk_token_id or eos is None or end == eos:
        return eos
    return [int(eos), end]


def _tokenizer_class(config: PretrainedConfig) -> type[PreTrainedTokenizerBase]:
    """The class AutoTokenizer picks for a GGUF file of this config's model type.

    NOTE: AutoTokenizer.from_pretrained(gguf_file=...) re-parses the whole GGUF metadata only to
    rebuild the config we already have (~5 s for SmolLM2); asking its mapping directly skips
    that. The e2e test checks the result against AutoTokenizer itself.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    mapped: Any = TOKENIZER_MAPPING.get(type(config), None)
    if isinstance(mapped, tuple):  # transformers 4.x maps a config to (slow, fast)
        mapped = mapped[1] or mapped[0]
    return cast("type[PreTrainedTokenizerBase]", mapped or PreTrainedTokenizerFast)


def _has_chat_template(folder: Path) -> bool:
    """transformers 5 writes chat_template.jinja; 4.x put it in tokenizer_config.json."""
    if (folder / "chat_template.jinja").is_file():
        return True
    config = json.loads((folder / "tokenizer_config.json").read_text())
    return bool(config.get("chat_template"))
