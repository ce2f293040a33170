"""EngineConfig: the one frozen configuration of a weft runtime (with its TuningConfig), validated
at construction."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from weft.constrain.limits import GrammarLimits
from weft.kernels.common import FP8_KV
from weft.runtime.config_types import check_fields, check_known
from weft.runtime.tuning import TuningConfig as TuningConfig  # (EngineConfig.tuning's type)

MAX_DRAFT_TOKENS = 64  # speculative_num_draft_tokens at most
DType = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_cache_dir() -> Path:
    """Where converted models live: $XDG_CACHE_HOME/weft or ~/.cache/weft."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "weft"


@dataclass(frozen=True)
class EngineConfig:
    """Everything a runtime needs, fixed for its lifetime.

    Sizes in tokens unless named otherwise. `None` means "derive it" (see the properties).
    """

    model: str | None = None  # HF folder, .gguf file, or None for the packaged SmolLM2
    tokenizer: str | None = None  # defaults to the model's own (a synthetic one: see loader)
    # no tokenizer anywhere (SGLang's): requests give input_ids, results carry output_ids, no text
    skip_tokenizer_init: bool = False
    load_format: Literal["auto", "dummy"] = "auto"
    # quantized weights: gguf keeps a GGUF file's Q4_0..Q8_0 / K-quant blocks as they are in
    # device memory (implied by a .gguf model unless dequantize; with load_format='dummy', random
    # blocks in llama.cpp's Q4_K_M layout); fp8: W8A8 (an FP8 checkpoint, or quantized at load)
    quantization: Literal["gguf", "fp8"] | None = None
    # a .gguf model converted to full precision at load (the HF folder of fp32 safetensors)
    # instead of kept quantized
    dequantize: bool = False
    dtype: DType = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    # the KV pool's element type: auto = the model dtype; fp8_e4m3 halves the pool's bytes (twice
    # the tokens in the same memory, half the bytes read per decode step) at fp8 precision
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0  # dummy weights and unseeded sampling
    context_length: int | None = None  # override the model's max_position_embeddings
    page_size: int | None = None  # default 1 on CPU, 16 on CUDA
    max_total_tokens: int | None = None  # KV pool size; overrides the memory budget
    kv_cache_bytes: int | None = None  # CPU budget for the KV pool (default 1 GiB)
    mem_fraction: float = 0.85  # GPU: fraction of total memory for weights + KV pool
    max_running_requests: int = 256
    tp_size: int = 1  # tensor parallelism: one scheduler process per rank (GPU r, or CPU + gloo)
    max_prefill_tokens: int = 8192  # token budget of one prefill batch
    chunked_prefill_size: int = 4096  # prompts longer than this are prefilled in chunks; 0: off
    # a prefill step also runs one token of every running request (they decode instead of
    # waiting for the prefill step to end); the prefill budget shrinks by their number
    enable_mixed_chunk: bool = False
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    # admission by predicted peak KV use (SGLang's knobs): a request with ignore_eos will use
    # its max_new_tokens; another is expected to use `new_token_ratio` of what it has left. The
    # ratio starts at init_new_token_ratio × schedule_conservativeness, decays to its floor
    # (× min_new_token_ratio_factor) over new_token_ratio_decay_steps decode steps, and a
    # retraction raises it to the running requests' decoded share + retract_decode_steps each
    schedule_conservativeness: float = 1.0
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retract_decode_steps: int = 20
    disable_radix_cache: bool = False
    # a model with both sliding-window and global layers (Gemma 3) keeps only a window's worth
    # of KV per request in its windowed layers (the hybrid SWA pool, as SGLang's); its SWA
    # tokens are this share of its full tokens
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False  # every layer keeps every token's KV
    attention_backend: str = "auto"
    disable_cuda_graph: bool = False  # CUDA: run decode eagerly instead of replaying graphs
    cuda_graph_max_bs: int = 256  # largest decode batch captured (bigger batches run eagerly)
    # triton decode: a KV prefix shared by several running requests (the same radix-tree slots)
    # is read once per group of requests instead of once per request
    disable_shared_prefix_decode: bool = False
    disable_fused_kernels: bool = False  # CUDA: torch ops instead of weft's Triton norm/rope/SiLU
    # the scheduler prepares step t+1 while the device runs step t; auto: on with CUDA (on the
    # CPU the model runs inside the call, so there is nothing to overlap)
    overlap_schedule: Literal["auto", "on", "off"] = "auto"
    grammar_backend: Literal["llguidance", "outlines"] = "llguidance"
    grammar_timeout: float = 10.0  # seconds a grammar may take to compile before a 400
    strict_schemas: bool = False  # the older spelling of grammar_strictness="strict"
    # JSON schemas with keywords the grammar cannot enforce exactly (uniqueItems, oneOf
    # exclusivity, not, ...): lenient compiles the rest and reports each finished output's
    # validity (meta_info schema_valid); strict refuses them (a 400 naming keyword and pointer)
    grammar_strictness: Literal["lenient", "strict"] = "lenient"
    # what one grammar may ask of the backend, checked before compiling (a 400 naming the limit;
    # constrain/limits.py GrammarLimits says why these defaults)
    grammar_max_repeat: int = 10_000  # a counted repetition's bound ({n,m}, Lark ~ n..m)
    grammar_max_expanded: int = 100_000  # a regex's items with counted repetitions multiplied out
    grammar_max_regex_chars: int = 100_000  # one regex (a request's, a pattern, a tag's)
    grammar_max_spec_chars: int = 1_000_000  # a JSON schema's, EBNF grammar's or tag's text
    # constrained decoding: sample forced tokens one by one (always so with overlap scheduling)
    disable_jump_forward: bool = False
    # reasoning models (SGLang's names): OpenAI chat answers carry the text between the think
    # markers as reasoning_content, and a chat request's constraint starts after the reasoning
    reasoning_parser: Literal["deepseek-r1", "qwen3"] | None = None
    # speculative decoding: `ngram` drafts from the request's own prompt and output (prompt
    # lookup), `draft` runs a small model with the same vocabulary ahead; one forward of the model
    # verifies the drafts. Greedy output is unchanged and sampled output keeps the model's
    # distribution (rejection sampling). With overlap scheduling, plain decode steps overlap as
    # usual and each verify step is processed before the next launch (its drafts need the tokens).
    speculative_algorithm: Literal["ngram", "draft"] | None = None
    speculative_draft_model_path: str | None = None  # `draft`: HF folder or .gguf file
    # tokens one verify step runs per request, its last accepted token included (SGLang's
    # meaning): up to this many minus one drafts
    speculative_num_draft_tokens: int = 5
    # `ngram`: the suffix matched against the earlier tokens is this many tokens long at least /
    # at most (the longest match wins, then the latest)
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # LoRA adapters (PEFT folders) served next to the base model, as SGLang's --lora-paths:
    # "name=path" entries (a bare path is named by itself); a request picks one by name
    # (lora_path). Keyword callers may pass a {name: path} dict or a list.
    lora_paths: tuple[str, ...] = ()
    # serve LoRA adapters loaded later (/load_lora_adapter) even with no lora_paths at start, as
    # SGLang's --enable-lora (the pool's rank then comes from max_lora_rank)
    enable_lora: bool = False
    max_loras_per_batch: int = 8  # distinct adapters in one batch (the device pool's slots)
    max_lora_rank: int | None = None  # the pool's rank; None: the largest loaded adapter's
    cache_dir: str | None = None  # converted models; default ~/.cache/weft
    cpu_threads: int | None = None  # torch intra-op threads of the scheduler on CPU; None: torch's
    log_level: str = "warning"
    tuning: TuningConfig = field(default_factory=TuningConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.load_format == "dummy" and self.model is None:
            raise ValueError("load_format='dummy' needs model= a folder with a config.json")
        self._check_quantization()
        if self.skip_tokenizer_init and self.tokenizer is not None:
            raise ValueError("skip_tokenizer_init loads no tokenizer: do not pass tokenizer= too")
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(
                f"dtype must be one of auto/float32/bfloat16/float16, got {self.dtype!r}"
            )
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {self.kv_cache_dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if self.page_size is not None and self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ValueError(
                f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}"
            )
        if not 0.0 < self.mem_fraction < 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.resolved_device == "cuda" and self.tp_size > torch.cuda.device_count():
            raise ValueError(
                f"tp_size={self.tp_size} needs {self.tp_size} GPUs, "
                f"but only {torch.cuda.device_count()} are visible"
            )
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.chunked_prefill_size < 0:
            raise ValueError(f"chunked_prefill_size must be >= 0, got {self.chunked_prefill_size}")
        if (
            self.chunked_prefill_size
            and self.page_size
            and self.chunked_prefill_size % self.page_size
        ):
            raise ValueError(
                f"chunked_prefill_size ({self.chunked_prefill_size}) must be a multiple of "
                f"page_size ({self.page_size})"
            )
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(
                f"schedule_policy must be 'fcfs' or 'lpm', got {self.schedule_policy!r}"
            )
        if not 0 <= self.schedule_conservativeness < math.inf:
            raise ValueError(
                "schedule_conservativeness must be a finite number >= 0, got "
                f"{self.schedule_conservativeness}"
            )
        if not 0.0 < self.init_new_token_ratio <= 1.0:
            raise ValueError(
                f"init_new_token_ratio must be in (0, 1], got {self.init_new_token_ratio}"
            )
        if not 0.0 <= self.min_new_token_ratio_factor <= 1.0:
            raise ValueError(
                "min_new_token_ratio_factor must be in [0, 1], got "
                f"{self.min_new_token_ratio_factor}"
            )
        if self.new_token_ratio_decay_steps < 1:
            raise ValueError(
                f"new_token_ratio_decay_steps must be >= 1, got {self.new_token_ratio_decay_steps}"
            )
        if self.retract_decode_steps < 0:
            raise ValueError(f"retract_decode_steps must be >= 0, got {self.retract_decode_steps}")
        if self.grammar_backend not in ("llguidance", "outlines"):
            raise ValueError(
                f"grammar_backend must be 'llguidance' or 'outlines', got {self.grammar_backend!r}"
            )
        if self.grammar_strictness not in ("lenient", "strict"):
            raise ValueError(
                f"grammar_strictness must be 'lenient' or 'strict', got {self.grammar_strictness!r}"
            )
        if self.reasoning_parser not in (None, "deepseek-r1", "qwen3"):
            raise ValueError(
                "reasoning_parser must be 'deepseek-r1', 'qwen3' or None, got "
                f"{self.reasoning_parser!r}"
            )
        if not self.grammar_timeout > 0:
            raise ValueError(f"grammar_timeout must be > 0 seconds, got {self.grammar_timeout}")
        for name in ("repeat", "expanded", "regex_chars", "spec_chars"):
            if getattr(self, f"grammar_max_{name}") < 1:
                value = getattr(self, f"grammar_max_{name}")
                raise ValueError(f"grammar_max_{name} must be >= 1, got {value}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(
                f"overlap_schedule must be 'auto', 'on' or 'off', got {self.overlap_schedule!r}"
            )
        self._check_speculative()
        self._check_lora()
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"log_level must be debug/info/warning/error, got {self.log_level!r}")

    def _check_quantization(self) -> None:
        if self.quantization not in (None, "gguf", "fp8"):
            raise ValueError(
                f"quantization must be 'gguf', 'fp8' or None, got {self.quantization!r}"
            )
        gguf_file = self.model is None or self.model.lower().endswith(".gguf")
        if self.dequantize and not gguf_file:
            raise ValueError(f"dequantize converts a .gguf model to full precision; model="
                             f"{self.model!r} is not a .gguf file")  # fmt: skip
        if self.dequantize and self.quantization == "gguf":
            raise ValueError("quantization='gguf' keeps the GGUF blocks and dequantize converts "
                             "them to full precision: pass one of the two")  # fmt: skip
        if self.quantization == "gguf" and not gguf_file and self.load_format != "dummy":
            raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks: model= must be a "
                             f".gguf file, got {self.model!r}")  # fmt: skip
        if self.resolved_quantization == "gguf" and self.tp_size > 1:
            raise ValueError("a GGUF model kept quantized runs on one rank (tp_size=1); pass "
                             "dequantize=True for tensor parallelism")  # fmt: skip
        if self.quantization == "fp8" and self.model is not None and gguf_file:
            if not self.dequantize and self.load_format != "dummy":
                raise ValueError("quantization='fp8' of a .gguf model needs dequantize=True "
                                 "(the blocks converted to full precision, then to fp8)")  # fmt: skip

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo not in (None, "ngram", "draft"):
            raise ValueError(
                f"speculative_algorithm must be 'ngram', 'draft' or None, got {algo!r}"
            )
        if (algo == "draft") != (self.speculative_draft_model_path is not None):
            raise ValueError("speculative_algorithm='draft' and speculative_draft_model_path= go "
                             "together: the draft model runs only with that algorithm")  # fmt: skip
        if not 2 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative_num_draft_tokens must be in [2, {MAX_DRAFT_TOKENS}] (the "
                             f"last accepted token and >= 1 draft), got "
                             f"{self.speculative_num_draft_tokens}")  # fmt: skip
        lo = self.speculative_ngram_min_match_window_size
        hi = self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError("speculative n-gram windows need 1 <= min_match_window_size <= "
                             f"max_match_window_size, got {lo} and {hi}")  # fmt: skip
        if algo is None:
            return
        if self.tp_size > 1:
            raise ValueError("speculative decoding runs on one rank (tp_size=1) for now")

    def _check_lora(self) -> None:
        if not isinstance(self.lora_paths, tuple) or not all(
            isinstance(e, str) and e for e in self.lora_paths
        ):
            raise ValueError(f"lora_paths must be 'name=path' strings, got {self.lora_paths!r}")
        entries = _lora_entries(self.lora_paths)
        if any(not name or not path for name, path in entries):
            raise ValueError(f"lora_paths entries are 'name=path', got {self.lora_paths!r}")
        names = [name for name, _ in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_paths names two adapters alike: {sorted(names)}")
        if self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if not self.lora_enabled:
            return
        if not self.lora_paths and self.max_lora_rank is None:
            raise ValueError("enable_lora without lora_paths needs max_lora_rank: the adapter "
                             "pool is sized before any adapter is loaded")  # fmt: skip
        if self.speculative_algorithm is not None:
            raise ValueError("LoRA adapters (lora_paths) do not run with speculative decoding yet")
        if self.resolved_quantization == "gguf":
            raise ValueError("LoRA adapters (lora_paths) need a full-precision or fp8 model, "
                             "not GGUF blocks kept quantized; pass dequantize=True")  # fmt: skip

    @property
    def lora_enabled(self) -> bool:
        """Whether LoRA adapters are served (enable_lora, or adapters given at start)."""
        return self.enable_lora or bool(self.lora_paths)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """Adapter name -> PEFT folder, in lora_paths order."""
        return dict(_lora_entries(self.lora_paths))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, naming any unknown one; paths may be os.PathLike, and
        `tuning` a TuningConfig or a dict of its fields."""
        check_known(cls, kwargs, "engine option")
        for name in _PATHS:
            if isinstance(kwargs.get(name), os.PathLike):
                kwargs[name] = os.fspath(kwargs[name])
        loras = kwargs.get("lora_paths")
        if isinstance(loras, dict):
            kwargs["lora_paths"] = tuple(f"{k}={os.fspath(v)}" for k, v in loras.items())
        elif isinstance(loras, (list, tuple)):
            kwargs["lora_paths"] = tuple(os.fspath(e) for e in loras)
        tuning = kwargs.get("tuning")
        if isinstance(tuning, dict):
            kwargs["tuning"] = TuningConfig.from_kwargs(**tuning)
        return cls(**kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """The inverse of `to_dict` (a child process rebuilds its parent's config)."""
        return cls.from_kwargs(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(
            max_regex_chars=self.grammar_max_regex_chars,
            max_grammar_chars=self.grammar_max_spec_chars,
            max_repeat=self.grammar_max_repeat,
            max_expanded=self.grammar_max_expanded,
        )

    @property
    def resolved_quantization(self) -> Literal["gguf", "fp8"] | None:
        """quantization, or 'gguf' for a .gguf model path without dequantize (the packaged
        default model, model=None, is converted to full precision unless quantization='gguf')."""
        if self.quantization is not None:
            return self.quantization
        if self.model is not None and self.model.lower().endswith(".gguf"):
            return None if self.dequantize or self.load_format == "dummy" else "gguf"
        return None

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's element type."""
        return FP8_KV if self.kv_cache_dtype == "fp8_e4m3" else self.torch_dtype

    @property
    def resolved_overlap(self) -> bool:
        if self.overlap_schedule == "auto":
            return self.resolved_device == "cuda"
        return self.overlap_schedule == "on"

    @property
    def resolved_page_size(self) -> int:
        if self.page_size is not None:
            return self.page_size
        return 16 if self.resolved_device == "cuda" else 1

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()


_PATHS = ("model", "tokenizer", "cache_dir", "speculative_draft_model_path")


def _lora_entries(entries: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, path) of each "name=path" entry; a bare path is its own name (SGLang's)."""
    out = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        out.append((name, path) if sep else (entry, entry))
    return out
