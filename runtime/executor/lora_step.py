"""LoRA serving on one rank: the adapters read at start (CPU) or in the background while serving,
their device pool, the sites that add the deltas in the model's projections, and each forward's
LoraBatch.

The scheduler pins a request's adapter while the request holds KV (KVCacheManager.admit ..
_drop): every request of a batch holds KV, so a batch has at most the pool's max_loras distinct
adapters, and an adapter in a batch is never evicted. Prefix caching keys each adapter's tokens
apart (`namespace`): two adapters never share KV.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from weft.runtime.config import EngineConfig
from weft.runtime.lora import (
    NO_LORA,
    LoraAdapter,
    LoraPool,
    LoraShapes,
    load_adapter,
    read_config,
    shard_adapter,
)
from weft.runtime.lora.forward import LoraBatch, LoraContext, LoraSite
from weft.runtime.models.layers import Projection

if TYPE_CHECKING:
    from weft.runtime.executor.batch import Batch
    from weft.runtime.executor.distributed import TPGroup

# a token id under adapter k (1-based, in lora_paths order) is keyed id + k * NAMESPACE_STRIDE in
# the radix tree: far above any vocabulary, so adapters (and the base model, k = 0) never meet
NAMESPACE_STRIDE = 1 << 32
logger = logging.getLogger(__name__)


class LoraRuntime:
    """The adapters of config.lora_paths served by `model` on this rank."""

    def __init__(
        self,
        config: EngineConfig,
        hf_config: Any,
        model: torch.nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
    ) -> None:
        paths = config.lora_adapters
        assert config.lora_enabled and (paths or config.max_lora_rank), "checked by the config"
        shapes = LoraShapes.from_hf_config(hf_config)
        max_rank = config.max_lora_rank or max(read_config(Path(p)).rank for p in paths.values())
        tp_size, tp_rank = (tp.size, tp.rank) if tp is not None else (1, 0)
        self.shapes, self.dtype, self.tp_size, self.tp_rank = shapes, dtype, tp_size, tp_rank
        self.tp = tp
        self.adapters: dict[str, LoraAdapter] = {}
        self.namespaces: dict[str, int] = {}
        self.next_namespace = 1  # never reused: a reloaded name never meets its old KV
        self.retiring: set[str] = set()  # unloaded, still used by requests sent before
        self._leaked: set[str] = set()  # retiring adapters pinned with no request: logged once
        # adapters being read off the scheduler loop: name -> (folder, the read's future)
        self.loading: dict[str, tuple[str, Future[LoraAdapter]]] = {}
        self._reader: ThreadPoolExecutor | None = None
        self.pool = LoraPool(shapes.for_rank(tp_size, tp_rank), config.max_loras_per_batch,
                             max_rank, dtype, device)  # fmt: skip
        for name, path in paths.items():
            self.load(name, path)
        self.context = LoraContext()
        self.device = device
        attach_sites(model, self.context)

    ##### Loading and unloading while serving #####

    def served(self) -> dict[str, str]:
        """Adapter name -> folder, for the adapters new requests may use."""
        return {n: a.path for n, a in self.adapters.items() if n not in self.retiring}

    def load(self, name: str, path: str) -> None:
        """Read adapter `path` as `name` now (at start); ValueError as `start_load`'s or the
        loader's, with everything left as it was."""
        self.start_load(name, path, background=False)
        ((_, error),) = self.finished_loads(wait=True)
        if error is not None:
            raise error

    def start_load(self, name: str, path: str, background: bool = True) -> None:
        """Begin reading adapter `path` as `name` in a worker thread (the scheduler loop goes on
        serving); `finished_loads` registers it. ValueError at once for a name in use. Not in
        the background, with tensor parallelism (every rank calls it in the same step), the
        ranks agree: a read that failed on any rank fails on all of them."""
        if name in self.retiring:
            raise ValueError(f"LoRA adapter {name!r} is still being unloaded (requests sent "
                             "before its unload still run): load it again once they finish")  # fmt: skip
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded: unload it first")
        if name in self.loading:
            raise ValueError(f"a LoRA adapter named {name!r} is being loaded")
        if not background:
            future: Future[LoraAdapter] = Future()
            try:
                future.set_result(self._read(name, path))
            except Exception as e:  # NOTE: reported by finished_loads, as a background read's
                future.set_exception(e)
            future = self._agreed(name, future)
        else:
            assert self.tp is None, "with tensor parallelism every rank reads in the same step"
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
            future = self._reader.submit(self._read, name, path)
        self.loading[name] = (path, future)

    def finished_loads(self, wait: bool = False) -> list[tuple[str, Exception | None]]:
        """Register the adapters whose read finished (all of them with `wait`): (name, None)
        for each one now served, (name, the read's error) for each one that failed."""
        out: list[tuple[str, Exception | None]] = []
        for name, (_, future) in list(self.loading.items()):
            if not wait and not future.done():
                continue
            del self.loading[name]
            try:
                adapter = future.result()
            except Exception as e:
                out.append((name, e))
                continue
            self.register(adapter)
            out.append((name, None))
        return out

    def register(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` (read and checked already, e.g. by a load) under its name, with a
        prefix-cache namespace of its own."""
        assert adapter.name not in self.adapters, f"{adapter.name!r} is served already"
        self.adapters[adapter.name] = adapter
        self.namespaces[adapter.name] = self.next_namespace * NAMESPACE_STRIDE
        self.next_namespace += 1

    def _read(self, name: str, path: str) -> LoraAdapter:
        adapter = load_adapter(name, path, self.shapes, self.pool.max_rank, self.dtype)
        return shard_adapter(adapter, self.tp_size, self.tp_rank)

    def _agreed(self, name: str, future: Future[LoraAdapter]) -> Future[LoraAdapter]:
        """`future` (a finished read) if every tensor-parallel rank's read worked, else one
        failed with the lowest failing rank's error (e.g. a folder only some ranks can read):
        all ranks serve the adapter or none does."""
        if self.tp is None:
            return future
        error = future.exception()
        first = self.tp.first_error(None if error is None else describe_error(error))
        if first is None or (error is not None and first[0] == self.tp_rank):
            return future
        rank, message = first
        failed: Future[LoraAdapter] = Future()
        failed.set_exception(ValueError(f"LoRA adapter {name!r}: tensor-parallel rank {rank} "
                                        f"could not read it: {message}"))  # fmt: skip
        return failed

    def unload(self, name: str) -> None:
        """Refuse new requests for `name` (the caller's intake) and free it once no request of
        it is left (retire); KeyError for a name not served."""
        if name not in self.adapters or name in self.retiring:
            raise KeyError(name)
        self.retiring.add(name)

    def retire(self, in_use: set[str]) -> None:
        """Free the unloaded adapters no request (`in_use`: every queued or running request's
        adapter) still needs: its pool slot, its CPU weights. Its radix entries are never hit
        again (their namespace is not reused) and age out of the cache. An adapter still
        pinned with no request using it (a leaked pin) is logged and kept, not freed under a
        request, and tried again on the next call."""
        for name in self.retiring - in_use:
            if not self.pool.drop(name):
                if name in self._leaked:
                    continue
                self._leaked.add(name)
                logger.error("LoRA adapter %r is unloaded and no request uses it, but %d pins "
                             "are held: kept", name, self.pool.pinned().get(name, 0))  # fmt: skip
                continue
            del self.adapters[name], self.namespaces[name]
            self.retiring.discard(name)
            self._leaked.discard(name)

    ##### The scheduler's side #####

    def namespace(self, name: str) -> int:
        return self.namespaces[name]

    def can_acquire(self, name: str) -> bool:
        return self.pool.can_acquire({name})

    def acquire(self, name: str) -> int:
        return self.pool.acquire(self.adapters[name])

    def release(self, name: str) -> None:
        self.pool.release(name)

    ##### The model's side #####

    def forward_state(self, batch: Batch, num_tokens: int) -> LoraBatch | None:
        """Each token's slot (its request's adapter), and on CUDA the kernels' index; None when
        no request of the batch has an adapter (the model then does no LoRA work)."""
        slots = [self.pool.slot_of(r.lora_path) if r.lora_path is not None else None
                 for r in batch.reqs]  # fmt: skip
        if all(s is None for s in slots):
            return None
        assert all(s is not None for r, s in zip(batch.reqs, slots, strict=True)
                   if r.lora_path is not None), "a LoRA request whose adapter is not resident"  # fmt: skip
        per_req = torch.tensor([NO_LORA if s is None else s for s in slots], dtype=torch.int32)
        lens = torch.tensor(batch.extend_lens, dtype=torch.int64)
        token_slots = torch.repeat_interleave(per_req, lens, output_size=num_tokens)
        token_slots = token_slots.to(self.device, non_blocking=True)
        index = None
        if self.device.type == "cuda":
            from weft.kernels.lora import default_block_m, lora_index

            index = lora_index(token_slots, self.pool.max_loras, default_block_m(num_tokens))
        return LoraBatch(self.pool, token_slots, index)


def describe_error(error: BaseException) -> str:
    """A failed read's message: the loader's own (the file and the problem), else its type too."""
    if isinstance(error, (ValueError, OSError)):
        return str(error)
    return f"{type(error).__name__}: {error}"


def attach_sites(model: torch.nn.Module, context: LoraContext) -> None:
    """A LoraSite on each adapted projection of a Llama-family model: ValueError for a model
    whose layers are not (an MoE model's experts take no LoRA here)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"LoRA adapters are not supported for {type(model).__name__}")
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        projections = {
            "qkv_proj": getattr(attn, "qkv_proj", None),
            "o_proj": getattr(attn, "o_proj", None),
            "gate_up_proj": getattr(mlp, "gate_up_proj", None),
            "down_proj": getattr(mlp, "down_proj", None),
        }
        missing = [name for name, p in projections.items() if not isinstance(p, Projection)]
        if missing:
            raise ValueError(
                f"LoRA adapters are not supported for {type(model).__name__}: layer {i} has no "
                f"dense {', '.join(missing)} (mixture-of-experts models take no LoRA yet)"
            )
        for fused, proj in projections.items():
            assert isinstance(proj, Projection)
            proj.lora = LoraSite(context, i, fused)
