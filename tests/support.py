"""Helpers the tests share (conftest.py holds the fixtures): offline tokenizers for random-weight
models, the kernels by name and a real `weft serve` process. Imported as `support` (pytest puts
tests/ on sys.path)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

# weft's kernel modules (kernels/ is a namespace folder: these are its contents)
KERNEL_MODULES = (
    "activation",
    "argmax",
    "arrivals",
    "attend",
    "bitmask",
    "decode",
    "extend",
    "kv_indices",
    "kv_store",
    "l2",
    "norm",
    "reference",
    "rotary",
    "shared_prefix",
    "skinny",
    "splits",
    "common",
)


def kernel_names(package: str) -> SimpleNamespace:
    """Every kernel module of `package` (weft.kernels, or kernels/ loaded by path) and the public
    names each defines, in one namespace: the tests call `wk.decode_attention`, `wk.decode`."""
    names: dict[str, object] = {}
    for name in KERNEL_MODULES:
        module: ModuleType = importlib.import_module(f"{package}.{name}")
        names[name.lstrip("_")] = module
        for attr, value in vars(module).items():
            if not attr.startswith("_") and getattr(value, "__module__", None) == module.__name__:
                names[attr] = value
    return SimpleNamespace(**names)


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer "w3 w4 ..." of exactly vocab_size ids (0 unk, 1 bos, 2 eos), built
    offline: for random-weight models whose vocabulary matches no real tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)


def save_byte_tokenizer(folder: Path) -> int:
    """A byte-level tokenizer (GPT-2's byte alphabet, no merges: text encodes to its UTF-8 bytes)
    with <pad> 0, <s> 1, </s> 2 and the 256 bytes at 3..258, built offline: random-weight models
    that must write any text (JSON, regexes) without the packaged model. Returns its size, 259."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({ch: len(specials) + i for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)
    return len(vocab)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """A real `weft serve` subprocess; `url` once /health answers 200."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        import subprocess

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "weft", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300.0) -> None:
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weft serve exited early:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"weft serve not ready after {timeout} s:\n{self.log_path.read_text()}")

    def stop(self) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return int(self.proc.returncode)


def save_tiny_llama(folder: Path, tokenizer_dir: Path, **config: Any) -> Path:
    """A 2-layer random Llama (seed 0) over SmolLM2's vocabulary into `folder`, with the tokenizer
    files of `tokenizer_dir`; `config`: LlamaConfig fields to change."""
    import shutil

    import torch
    import transformers

    fields: dict[str, Any] = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "architectures": ["LlamaForCausalLM"],
    }
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config})).eval()
    model.save_pretrained(folder, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def scheduler_greedy(config: Any, folder: Path, prompts: list[list[int]], new: int) -> list[Any]:
    """`new` greedy tokens per prompt (ignore_eos) through an in-process Scheduler of `config`
    (an EngineConfig), all prompts submitted at once; the KV conservation checked at the end."""
    from weft.runtime.executor.distributed import Inbox
    from weft.runtime.ipc.messages import TokenizedGenerateReq
    from weft.runtime.sampling_params import SamplingParams
    from weft.runtime.scheduler.scheduler import Scheduler

    sched = Scheduler(config, folder, None)
    done: dict[str, list[int]] = {}
    sched.emit = lambda reqs: done.update({r.rid: list(r.output_ids) for r in reqs if r.finished})
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    for i, ids in enumerate(prompts):
        sched.add_request(TokenizedGenerateReq(f"r{i}", ids, params, new))
    while sched.has_work():
        sched.apply(Inbox([], [], []))
        sched.process_results(sched.launch(sched.schedule()))
    sched.cache.check_conservation()
    return [done[f"r{i}"] for i in range(len(prompts))]


def hf_greedy(hf: Any, prompts: list[list[int]], new: int) -> list[list[int]]:
    """`new` greedy tokens per prompt from a transformers model's generate (EOS ignored)."""
    import torch

    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            got = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                              pad_token_id=0)  # fmt: skip
            out.append(got[0, len(ids) :].tolist())
    return out
