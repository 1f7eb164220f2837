"""CpuModelRunner: turns a ScheduledBatch into flat model inputs, runs the model, samples next tokens.

The reference implementation of base.ModelRunner (CPU, any dtype): one attention call per sequence
(kv_cache.PagedAttention), no kernels of our own. On CUDA the engine uses gpu_runner.GpuModelRunner instead
(core/engine.py picks), which computes the same steps with batched Triton kernels and CUDA graphs.

One decode step: `launch` -> `prepare` (ids, positions, cache slots) -> the model's forward
(clawrl/models/decoder.py) with PagedAttention as its attention backend -> the requests' logit rules
(`shape_logits`) -> `sample` (sampler.py), both in base.sample_step. Requests that ask also get their prompt and top logprobs
(base.record_prompt_logprobs / record_top_logprobs).

Shapes: N = new tokens of the step over all sequences (flat, no batch dim), M = sequences that sample.
Only the last position of a sequence that reaches its end this step goes through the LM head: a chunk in
the middle of a long prompt, or prefix recomputation after preemption, produces no logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from clawrl.engine.config import EngineConfig
from clawrl.engine.core.scheduler import ScheduledBatch
from clawrl.engine.core.sequence import PENDING_TOKEN, Sequence
from clawrl.engine.runner.base import StepHandle, record_prompt_logprobs, sample_step
from clawrl.engine.runner.kv_cache import KVCache, PagedAttention, PagedBatch, causal_offset_mask
from clawrl.models.config import load_model_args
from clawrl.models.loader import iter_safetensors, load_weights
from clawrl.models.tp import TensorParallel, full_hf_tensors, load_sharded_model, local_args


@dataclass(kw_only=True)
class StepInputs:
    """Flat model inputs of one step."""

    input_ids_N: torch.Tensor
    """Token ids of every new token, LongTensor [N]."""
    positions_N: torch.Tensor
    """Position of every new token in its sequence, LongTensor [N]."""
    paged: PagedBatch
    """Attention layout (cache slots, per-sequence bounds and masks)."""
    sample_rows_M: torch.Tensor
    """Row of N holding the last token of each sampling sequence, LongTensor [M]."""
    sampling_seqs: list[Sequence]
    """The M sequences that sample, in row order."""


class CpuModelRunner:
    """Runs one scheduled step of a CausalLM over the paged KV cache (the reference path; base.ModelRunner)."""

    def __init__(
        self, model: torch.nn.Module, kv_cache: KVCache, *, tp: TensorParallelLeader | None = None
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.tp = tp  # tensor parallel: the other ranks run the same forward on their shards, in lock step
        self.attention = PagedAttention(kv_cache)
        self._last_tokens: dict[int, int] = {}  # seq_id -> token sampled by the last launch

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[float]]:
        """Forward the batch; returns (sampling sequences, their next tokens, those tokens' logprobs)."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> StepHandle:
        """Start the step (here: compute it); `collect` returns its results. Sequences whose last token is
        PENDING_TOKEN get the token this runner sampled for them in the previous launch."""
        inputs = self.prepare(batch)
        if self.tp is not None:
            self.tp.send_step(inputs)
        self.attention.begin(inputs.paged)
        hidden_ND = self.model(inputs.input_ids_N, inputs.positions_N, self.attention)
        self.attention.batch = None
        record_prompt_logprobs(self.model, batch, hidden_ND)
        seqs = inputs.sampling_seqs
        if not seqs:
            return StepHandle(seqs=[], tokens=[], logprobs=[])
        handle = sample_step(self.model.compute_logits(hidden_ND[inputs.sample_rows_M]), seqs)
        self._last_tokens = {seq.seq_id: token for seq, token in zip(seqs, handle.tokens, strict=True)}
        return handle

    def collect(self, handle: StepHandle) -> tuple[list[Sequence], list[int], list[float]]:
        """(sampling sequences, their next tokens, those tokens' logprobs) of a launched step."""
        return handle.seqs, handle.tokens, handle.logprobs

    def capture_cuda_graphs(self) -> None:
        """No CUDA graphs on this path."""

    def invalidate_cuda_graphs(self) -> None:
        """No CUDA graphs on this path."""

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Build ids, positions, cache slots and masks for every scheduled chunk."""
        device = self.kv_cache.device
        block_size = self.kv_cache.block_size
        offsets = torch.arange(block_size)
        ids: list[int] = []
        positions: list[int] = []
        new_slots, context_slots, masks, bounds, sample_rows = [], [], [], [0], []
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            ids.extend(seq.token_ids(start, end))
            if (
                ids[-1] == PENDING_TOKEN
            ):  # overlap schedule: sampled by the previous launch, not yet collected
                ids[-1] = self._last_tokens[seq.seq_id]
            positions.extend(range(start, end))
            table = torch.tensor(seq.block_table[: -(-end // block_size)], dtype=torch.long)
            slots = (table.unsqueeze(1) * block_size + offsets).flatten()[:end]
            new_slots.append(slots[start:])
            context_slots.append(slots.to(device))
            masks.append(causal_offset_mask(num_new, end, device))
            bounds.append(bounds[-1] + num_new)
            if batch.samples(i):
                sample_rows.append(bounds[-1] - 1)
        paged = PagedBatch(
            slot_mapping_N=torch.cat(new_slots).to(device),
            query_bounds=bounds,
            context_slots=context_slots,
            masks=masks,
        )
        return StepInputs(
            input_ids_N=torch.tensor(ids, dtype=torch.long, device=device),
            positions_N=torch.tensor(positions, dtype=torch.long, device=device),
            paged=paged,
            sample_rows_M=torch.tensor(sample_rows, dtype=torch.long, device=device),
            sampling_seqs=[s for i, s in enumerate(batch.seqs) if batch.samples(i)],
        )


# ---------------------------------------------------------------------------------------------------------
# Tensor parallelism (EngineConfig.tp_size > 1): the engine process is rank 0; it starts ranks 1..N-1 as
# subprocesses running `tp_worker_main`, then drives them in lock step. Every step, rank 0 sends the step's
# flat inputs (ids, positions, cache slots, per-sequence bounds: one int64 tensor) and every rank runs the
# forward on its shard (clawrl/models/tp.py: the row-parallel layers all-reduce inside). The LM head is
# replicated, so logits and sampling stay on rank 0: the workers stop at the final hidden states. Weight
# updates arrive at rank 0 as full tensors; it forwards them and each rank keeps its slice (ShardOnLoad).
# Subprocesses, not torch.multiprocessing or Ray actors: the same start works standalone (`clawrl engine`),
# inside a Ray actor and under pytest, and a subprocess re-imports nothing of its parent's __main__.


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TensorParallelLeader:
    """Rank 0's handle on the worker ranks: start them, send each step, forward weights and memory calls."""

    def __init__(self, tp: TensorParallel, procs: list[subprocess.Popen]) -> None:
        self.tp = tp
        self.procs = procs

    @classmethod
    def start(cls, config: EngineConfig, *, timeout_s: float = 300.0) -> TensorParallelLeader:
        """Spawn ranks 1..tp_size-1 and form the group with them (deadline: timeout_s)."""
        backend = "nccl" if config.device.startswith("cuda") else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < config.tp_size:
            raise ValueError(
                f"--rollout-num-gpus-per-engine / tp_size {config.tp_size} on CUDA needs {config.tp_size} GPUs "
                f"visible to the engine process, it sees {torch.cuda.device_count()} (under Ray each engine "
                "actor sees one GPU: tensor-parallel engines on GPUs run standalone for now, docs/engine.md)"
            )
        port = _free_port()
        spec = {"config": dataclasses.asdict(config), "size": config.tp_size, "port": port, "backend": backend,
                "num_threads": max(1, torch.get_num_threads() // config.tp_size), "timeout_s": timeout_s}  # fmt: skip
        procs = []
        for rank in range(1, config.tp_size):
            code = f"from clawrl.engine.runner.cpu_runner import tp_worker_main; tp_worker_main({rank})"
            proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
            procs.append(proc)
        try:
            tp = TensorParallel.join(rank=0, size=config.tp_size, address="127.0.0.1", port=port,
                                     backend=backend, timeout_s=timeout_s)  # fmt: skip
        except BaseException:
            for proc in procs:
                proc.kill()
            raise
        return cls(tp, procs)

    def share_kv_blocks(self, num_blocks: int) -> None:
        """Rank 0 sized the KV cache; every rank allocates the same number of blocks (same block tables)."""
        self.tp.broadcast_json({"num_kv_blocks": num_blocks})

    def send_step(self, inputs: StepInputs) -> None:
        paged = inputs.paged
        ctx_lens = [len(slots) for slots in paged.context_slots]
        self.tp.broadcast_json({"op": "step", "n": int(inputs.input_ids_N.numel()), "s": len(ctx_lens)})
        flat = torch.cat([
            inputs.input_ids_N.cpu(), inputs.positions_N.cpu(), paged.slot_mapping_N.cpu(),
            torch.tensor(paged.query_bounds + ctx_lens, dtype=torch.long), *(s.cpu() for s in paged.context_slots),
        ])  # fmt: skip
        self.tp.broadcast(torch.tensor([flat.numel()]), control=True)
        self.tp.broadcast(flat, control=True)

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Send full tensors to every worker (each keeps its slice); rank 0 loads its own separately."""
        self.tp.broadcast_json({"op": "load", "names": [n for n, _ in named_tensors],
                                "shapes": [list(t.shape) for _, t in named_tensors],
                                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named_tensors]})  # fmt: skip
        device = self._data_device()
        for _, tensor in named_tensors:
            self.tp.broadcast(tensor.detach().to(device).contiguous())

    def load_from_disk(self, model_path: str) -> None:
        self.tp.broadcast_json({"op": "load_disk", "path": model_path})

    def memory(self, op: str, tags: list[str]) -> None:
        """ "release" / "resume" the workers' KV cache and weights (tags as Engine's)."""
        self.tp.broadcast_json({"op": op, "tags": tags})

    def full_hf_tensors(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full HF tensors, gathered from every rank's slices (for weight checksums)."""
        self.tp.broadcast_json({"op": "gather"})
        return full_hf_tensors(model, self.tp)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (they also exit on their own when this process dies)."""
        with contextlib.suppress(Exception):  # a dead worker: nothing to tell it
            self.tp.broadcast_json({"op": "stop"})
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()

    def _data_device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.tp.backend == "nccl"
            else torch.device("cpu")
        )


def tp_worker_main(rank: int) -> None:
    """Entry point of worker rank `rank` (a subprocess started by TensorParallelLeader.start; its spec comes
    on stdin). Runs until rank 0 says stop, or exits when rank 0's process is gone."""
    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(spec["num_threads"])
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    config = EngineConfig(**spec["config"])
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)  # standalone: rank r on the r-th visible GPU (UNTESTED here)
        torch.cuda.set_device(device)
    tp = TensorParallel.join(rank=rank, size=spec["size"], address="127.0.0.1", port=spec["port"],
                             backend=spec["backend"], timeout_s=spec["timeout_s"])  # fmt: skip
    worker = _TensorParallelWorker(config, tp, device)
    while worker.handle(tp.broadcast_json()):
        pass


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


class _TensorParallelWorker:
    """A worker rank's model shard and KV cache, and what it does for each message of rank 0."""

    def __init__(self, config: EngineConfig, tp: TensorParallel, device: torch.device) -> None:
        self.config, self.tp, self.device = config, tp, device
        self.dtype = getattr(torch, config.dtype)
        self.model = load_sharded_model(config.model_path, tp, device=device, dtype=self.dtype)
        args = local_args(load_model_args(config.model_path), tp.size)
        num_blocks = tp.broadcast_json()["num_kv_blocks"]
        self.kv_cache = KVCache(num_layers=args.num_layers, num_blocks=num_blocks, block_size=config.block_size,
                                num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype=self.dtype,
                                device=device)  # fmt: skip
        self.attention = PagedAttention(self.kv_cache)

    def handle(self, message: dict) -> bool:
        """Do what rank 0 asked; False on "stop"."""
        op = message["op"]
        if op == "step":
            self.step(message["n"], message["s"])
        elif op == "load":
            self.load(message)
        elif op == "load_disk":
            load_weights(self.model, iter_safetensors(message["path"]))
        elif op == "gather":
            full_hf_tensors(self.model, self.tp)
        elif op in ("release", "resume"):
            self.memory(op, message["tags"])
        elif op == "stop":
            return False
        else:
            raise ValueError(f"tensor-parallel worker: unknown message {message!r}")
        return True

    @torch.inference_mode()
    def step(self, num_tokens: int, num_seqs: int) -> None:
        size = self.tp.broadcast(torch.zeros(1, dtype=torch.long), control=True)
        flat = self.tp.broadcast(torch.empty(int(size[0]), dtype=torch.long), control=True)
        ids, positions, slots, rest = flat.split(
            [num_tokens, num_tokens, num_tokens, flat.numel() - 3 * num_tokens]
        )
        bounds, ctx_lens = rest[: num_seqs + 1].tolist(), rest[num_seqs + 1 : 2 * num_seqs + 1].tolist()
        context = rest[2 * num_seqs + 1 :].to(self.device).split(ctx_lens)
        masks = [causal_offset_mask(end - start, c, self.device)
                 for start, end, c in zip(bounds[:-1], bounds[1:], ctx_lens, strict=True)]  # fmt: skip
        self.attention.begin(PagedBatch(slot_mapping_N=slots.to(self.device), query_bounds=bounds,
                                        context_slots=list(context), masks=masks))  # fmt: skip
        self.model(ids.to(self.device), positions.to(self.device), self.attention)
        self.attention.batch = None

    def load(self, message: dict) -> None:
        device = self.device if self.tp.backend == "nccl" else torch.device("cpu")
        named = []
        for name, shape, dtype in zip(message["names"], message["shapes"], message["dtypes"], strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            named.append((name, self.tp.broadcast(tensor)))
        load_weights(self.model, named, strict=False)

    def memory(self, op: str, tags: list[str]) -> None:
        if "kv_cache" in tags:
            self.kv_cache.release() if op == "release" else self.kv_cache.resume()
        if "weights" in tags and self.device.type != "cpu":
            self.model.to("cpu" if op == "release" else self.device)
