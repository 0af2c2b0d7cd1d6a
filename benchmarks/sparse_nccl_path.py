"""vLLM 0.33's ``sparse_nccl`` weight transfer on CPU gloo: the baseline of issue 42 item 6.

    python benchmarks/sparse_nccl_path.py [--ranks 2] [--numel 4000000] [--density 0.03]
    .venv-vllm/bin/python benchmarks/sparse_nccl_path.py --engine vllm   # vLLM's classes

Wire format (read from vLLM 0.33, ``vllm/distributed/weight_transfer/``):

- The *caller* computes the patches: per checkpoint tensor a ``SparseWeightPatch(name,
  indices, values, full_shape)`` (``sparse_nccl_engine.py``); ``indices`` int32, 1-D,
  flat into the full checkpoint tensor; ``values`` 1-D in the checkpoint dtype; no
  compression, no packing ("sparse transfers are never packed"), no batching of tensors
  into one buffer. ``_validate_patch`` rejects non-int32 indices.
- ``SparseNCCLTrainerWeightTransferEngine.send_weights`` -> ``_broadcast_chunk``: one
  control-plane RPC ``client.update_weights(asdict(SparseNCCLWeightTransferUpdateInfo))``
  carrying ``names``, ``dtype_names``, ``shapes`` (full), ``num_updates_list`` (k per
  patch) - JSON over HTTP or a Ray call, never on NCCL - run on a side thread while
  trainer rank 0 issues, per patch in order, ``broadcast(indices, src=0)`` then
  ``broadcast(values, src=0)`` on the trainer<->workers NCCL group (trainer rank 0,
  workers at ``1 + dp * tp_pp + rank``: ``nccl_common._worker_group_rank``).
  ``start_weight_update`` / ``finish_weight_update`` RPCs frame it (no-ops on workers).
- Worker: ``SparseNCCLWeightTransferEngine.receive_weights`` allocates int32 and value
  buffers of ``num_updates``, receives both broadcasts per patch, holds *all* patches,
  then ``checkpoint_weight_patch.load_checkpoint_weight_patches``: per patch a full
  checkpoint-shaped tensor filled with NaN, ``index_copy_`` of the values, batched to
  <= 512 MiB of full tensors per ``model.load_weights`` call, with ``Tensor.copy_``
  swapped for ``torch.where(isnan(src), dst, src)`` so the model's own loader (TP
  narrowing, fused params) writes only the changed elements of this rank's shard.
  (``send_weight_chunk`` lets a caller split one update into several such chunks, one
  ``update_weights`` RPC each; the data messages stay the same. We use ``send_weights``.)

So every inference rank receives the whole tensor's patch, k * (4 + itemsize) bytes,
whatever shard it keeps: per step the data plane moves R * sum_t k_t * (4 + s_t) bytes
(R inference ranks). That total does not depend on the broadcast algorithm; the
trainer's egress does (NCCL's ring: one copy; a star: R copies). Here the broadcast is
a star of point-to-point gloo sends from rank 0, as this repository's gather-broadcast
baseline sends, so trainer egress = the total; ``payload_bytes`` is the one-copy figure.

Engines: ``engine="vllm"`` (needs vLLM importable, e.g. ``.venv-vllm``) drives vLLM's
own ``SparseNCCLTrainerWeightTransferEngine.send_weights`` and
``SparseNCCLWeightTransferEngine.receive_weights`` (hence its
``load_checkpoint_weight_patches``): only their NCCL communicator is replaced by a gloo
shim with the same ``broadcast(tensor, src, stream)``, ``torch.cuda.current_stream``
returns None, and the worker skips ``update_weights``' ``torch.accelerator.synchronize()``
(CPU ops are synchronous). ``engine="replica"`` reproduces those functions below, the
same messages in the same order (``tests/test_sparse_nccl_path.py`` checks they agree).
Which elements changed is decided by bit pattern (like slime), so -0.0/+0.0 changes are
sent; NaN values cannot be (NaN is vLLM's "unchanged" sentinel; its loader rejects them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK_BYTES = 512 << 20  # checkpoint_weight_patch._DEFAULT_PATCH_CHUNK_BYTES


@dataclass
class StepResult:
    """One refit (steps[i-1] -> steps[i]) over the sparse_nccl path."""

    step: int
    patches: int  # tensors sent (each: one indices and one values broadcast)
    changed: int  # elements sent, sum of k
    elements: int  # elements in the checkpoint
    payload_bytes: int  # one copy of every patch: sum k * (4 + itemsize)
    bytes_sent: int  # data plane, all receivers: R * payload_bytes
    busiest_rank_bytes: int  # trainer rank 0's egress (star broadcast): = bytes_sent
    metadata_bytes: int  # the update_weights RPC body as JSON (control plane, once)
    seconds: float  # trainer's send_weights: start RPC .. workers applied .. finish RPC
    bit_exact: bool  # every inference rank's shards equal steps[i]'s


@dataclass
class Patch:
    """``SparseWeightPatch`` (``sparse_nccl_engine.py``): checkpoint coordinates."""

    name: str
    indices: torch.Tensor
    values: torch.Tensor
    full_shape: tuple[int, ...]


def sparse_patches(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], include_unchanged: bool = False
) -> list[Patch]:
    """The caller's side of sparse_nccl: per tensor (in ``new``'s order) the flat int32
    indices whose bits differ and the new values there. Unchanged tensors are left out
    unless ``include_unchanged`` (then they go as empty patches: zero-size broadcasts)."""
    patches = []
    for name, cur in new.items():
        a, b = old[name].reshape(-1), cur.reshape(-1)
        if b.numel() > torch.iinfo(torch.int32).max:
            raise ValueError(f"{name}: {b.numel()} elements do not fit int32 indices")
        bits = _BITS[b.element_size()]
        idx = (a.view(bits) != b.view(bits)).nonzero().reshape(-1).to(torch.int32)
        if idx.numel() or include_unchanged:
            patches.append(Patch(name, idx, b[idx.long()].clone(), tuple(cur.shape)))
    return patches


def payload_bytes(patches: list[Patch]) -> int:
    """Bytes of one copy of every broadcast: sum k * 4 + k * itemsize."""
    return sum(p.indices.nbytes + p.values.nbytes for p in patches)


def update_info(patches: list[Patch]) -> dict[str, Any]:
    """``asdict(SparseNCCLWeightTransferUpdateInfo)`` as ``_broadcast_chunk`` builds it."""
    return {
        "names": [p.name for p in patches],
        "dtype_names": [str(p.values.dtype).split(".")[-1] for p in patches],
        "shapes": [list(p.full_shape) for p in patches],
        "num_updates_list": [p.indices.numel() for p in patches],
    }


class GlooBroadcast:
    """Stands in for vLLM's ``PyNcclCommunicator``: ``broadcast(tensor, src, stream)`` as a
    star of gloo sends from ``src`` (0) to every other rank of ``group``."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.device = torch.device("cpu")
        self.sent = 0  # bytes this rank sent

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        if tensor.numel() == 0:  # NCCL moves nothing; gloo needs no message either
            return
        if self.rank == src:
            peers = [r for r in range(self.world) if r != src]
            for work in [dist.isend(tensor, r, group=self.group) for r in peers]:
                work.wait()
            self.sent += tensor.nbytes * len(peers)
        else:
            dist.recv(tensor, src, group=self.group)

    def destroy(self) -> None:
        pass


class ControlClient:
    """``VLLMWeightSyncClient`` over a second gloo group: each RPC is a command object
    broadcast from the trainer, run by every worker, then acknowledged (gathered)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.metadata_bytes = 0

    def call(self, *command: Any) -> None:
        dist.broadcast_object_list([command], src=0, group=self.group)
        errors = [None] * dist.get_world_size(self.group)
        dist.gather_object(None, errors, dst=0, group=self.group)
        failed = [e for e in errors if e]
        if failed:
            raise RuntimeError(f"inference rank failed: {failed[0]}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init", init_info)

    def start_weight_update(self) -> None:
        self.call("start")

    def update_weights(self, info: dict[str, Any]) -> None:
        self.metadata_bytes += len(json.dumps({"update_info": info}))  # HTTP body
        self.call("update", info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish")


class ReplicaTrainerEngine:
    """``SparseNCCLTrainerWeightTransferEngine.send_weights`` / ``_broadcast_chunk``."""

    def __init__(self, client: ControlClient, group: GlooBroadcast) -> None:
        self.client, self.model_update_group = client, group

    def send_weights(self, patches: list[Patch]) -> None:
        if not patches:  # "An empty patch list is a no-op"
            return
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as executor:
            future = executor.submit(self.client.update_weights, update_info(patches))
            for p in patches:
                self.model_update_group.broadcast(p.indices, src=0, stream=None)
                self.model_update_group.broadcast(p.values, src=0, stream=None)
            future.result()
        self.client.finish_weight_update()


class ReplicaWorkerEngine:
    """``SparseNCCLWeightTransferEngine.receive_weights`` (no-op start / finish)."""

    def __init__(self, model: torch.nn.Module, group: GlooBroadcast) -> None:
        self.model, self.model_update_group = model, group

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def receive(self, info: dict[str, Any]) -> None:
        patches = []
        for name, dtype_name, shape, k in zip(
            info["names"], info["dtype_names"], info["shapes"], info["num_updates_list"]
        ):
            dtype = getattr(torch, dtype_name)
            indices = torch.empty(k, dtype=torch.int32)
            values = torch.empty(k, dtype=dtype)
            self.model_update_group.broadcast(indices, src=0)
            self.model_update_group.broadcast(values, src=0)
            patches.append((name, tuple(shape), dtype, values, indices))
        load_patches(self.model, patches)


def load_patches(model: torch.nn.Module, patches: list[tuple]) -> None:
    """``load_checkpoint_weight_patches`` for sparse patches: NaN-filled full tensors,
    ``index_copy_`` of the values, one ``load_weights`` per <= 512 MiB of full tensors
    (or on a repeated name), with the NaN-preserving ``copy_`` installed."""
    for _, shape, _, values, indices in patches:  # the checks vLLM makes before loading
        bad = torch.isnan(values).any()
        if indices.numel():
            ordered = torch.sort(indices).values
            bad |= (ordered[0] < 0) | (ordered[-1] >= math.prod(shape))
            bad |= (ordered[1:] == ordered[:-1]).any()
        if bad:
            raise ValueError("Sparse checkpoint patches contain NaN values, out-of-range "
                             "indices, or duplicate indices")  # fmt: skip
    chunk: list[tuple[str, torch.Tensor]] = []
    names: set[str] = set()
    size = 0
    for name, shape, dtype, values, indices in patches:
        nbytes = math.prod(shape) * dtype.itemsize
        if chunk and (size + nbytes > _CHUNK_BYTES or name in names):
            _load_nan_masked(model, chunk)
            chunk, names, size = [], set(), 0
        flat = torch.full((math.prod(shape),), float("nan"), dtype=dtype)
        if values.numel():
            flat.index_copy_(0, indices.long(), values.to(dtype))
        chunk.append((name, flat.view(shape)))
        names.add(name)
        size += nbytes
    _load_nan_masked(model, chunk)


def _load_nan_masked(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
    """``_load_nan_masked_weights``: ``copy_`` keeps the destination where source is NaN."""
    if not weights:
        return
    original = torch.Tensor.copy_

    def copy_non_nan_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
        src = src.to(dtype=dst.dtype, device=dst.device)
        return torch.where(torch.isnan(src), dst, src, out=dst)

    torch.Tensor.copy_ = copy_non_nan_
    try:
        model.load_weights(weights)
    finally:
        torch.Tensor.copy_ = original


class ShardedModel(torch.nn.Module):
    """An inference rank's weights: each tensor's dim-0 TP shard (whole when dim 0 does
    not divide), loaded as vLLM's default weight loader does - narrow, then ``copy_``."""

    def __init__(self, weights: dict[str, torch.Tensor], tp: int, tp_rank: int) -> None:
        super().__init__()
        self.tp, self.tp_rank = tp, tp_rank
        self.shards = {name: self.shard(w).clone() for name, w in weights.items()}

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        if full.dim() == 0 or full.shape[0] % self.tp:
            return full
        rows = full.shape[0] // self.tp
        return full.narrow(0, self.tp_rank * rows, rows)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        for name, full in weights:
            self.shards[name].copy_(self.shard(full))
        return {name for name, _ in weights}

    def equals(self, weights: dict[str, torch.Tensor]) -> bool:
        bits = {n: _BITS[w.element_size()] for n, w in weights.items()}
        return all(
            torch.equal(self.shards[n].view(bits[n]), self.shard(w).view(bits[n]))
            for n, w in weights.items()
        )


def _vllm_engines(rank: int, model: torch.nn.Module, data: GlooBroadcast, client: ControlClient):
    """vLLM's own sparse_nccl classes around the gloo shim (see the module docstring)."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import sparse_nccl_engine as sne

    torch.cuda.current_stream = lambda *a, **k: None  # the shim ignores streams
    if rank == 0:
        trainer = sne.SparseNCCLTrainerWeightTransferEngine(client=client)
        trainer.model_update_group = data
        return trainer, lambda ps: [sne.SparseWeightPatch(**asdict(p)) for p in ps]
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(), model_config=None)
    worker = sne.SparseNCCLWeightTransferEngine(
        WeightTransferConfig(backend="sparse_nccl"), cfg, torch.device("cpu"), model
    )
    worker.model_update_group = data
    # update_weights minus torch.accelerator.synchronize() (no accelerator on CPU)
    worker.receive = lambda info: worker.receive_weights(worker.parse_update_info(info))
    return worker, None


def _rank_main(
    rank: int, world: int, port: int, steps: list[dict[str, torch.Tensor]], tp: int,
    engine: str, include_unchanged: bool, out: str,
) -> None:  # fmt: skip
    store = dist.PrefixStore("sparse_nccl", dist.TCPStore("127.0.0.1", port, is_master=False))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ctrl = dist.new_group(backend="gloo")
    data = GlooBroadcast(dist.group.WORLD, rank, world)
    model = ShardedModel(steps[0], tp, (rank - 1) % tp) if rank else None
    client = ControlClient(ctrl)
    if engine == "vllm":
        eng, to_patch = _vllm_engines(rank, model, data, client)
    else:
        eng = ReplicaTrainerEngine(client, data) if rank == 0 else ReplicaWorkerEngine(model, data)
        to_patch = lambda ps: ps  # noqa: E731
    dist.barrier(group=ctrl)  # every rank set up (vLLM imports take seconds): untimed
    if rank == 0:
        results = []
        for i in range(1, len(steps)):
            patches = sparse_patches(steps[i - 1], steps[i], include_unchanged)
            sent0, meta0 = data.sent, client.metadata_bytes
            t0 = time.perf_counter()
            eng.send_weights(to_patch(patches))
            seconds = time.perf_counter() - t0
            dist.broadcast_object_list([("check", i)], src=0, group=ctrl)
            oks = [None] * world
            dist.gather_object(None, oks, dst=0, group=ctrl)
            one = payload_bytes(patches)
            results.append(StepResult(
                i, len(patches), sum(p.indices.numel() for p in patches),
                sum(w.numel() for w in steps[i].values()), one, one * (world - 1),
                data.sent - sent0, client.metadata_bytes - meta0, seconds,
                all(ok is True for ok in oks[1:]),
            ))  # fmt: skip
        dist.broadcast_object_list([("stop",)], src=0, group=ctrl)
        with open(out, "w") as f:
            json.dump([asdict(r) for r in results], f)
    else:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=ctrl)
            command = box[0]
            if command[0] == "stop":
                break
            reply: Any = None
            try:
                if command[0] == "check":
                    reply = model.equals(steps[command[1]])
                elif command[0] == "update":
                    eng.receive(command[1])
                else:
                    getattr(eng, f"{command[0]}_weight_update")()
            except Exception as err:  # reported to the trainer, which raises it
                reply = f"rank {rank}: {type(err).__name__}: {err}"
            dist.gather_object(reply, None, dst=0, group=ctrl)
    dist.destroy_process_group()


def run_sparse_nccl(
    steps: list[dict[str, torch.Tensor]],
    num_inference_ranks: int,
    inference_tp: int = 1,
    engine: str = "auto",
    include_unchanged: bool = False,
) -> list[StepResult]:
    """Refit ``steps[0] -> steps[1] -> ...`` (full canonical tensors, name -> tensor; the
    inference ranks start at ``steps[0]``) from trainer rank 0 to ``num_inference_ranks``
    spawned gloo ranks (replicas of ``inference_tp`` ranks each, keeping dim-0 shards);
    one :class:`StepResult` per refit. ``engine``: "vllm", "replica" or "auto" (vLLM's
    classes when vLLM imports here)."""
    import importlib.util
    import tempfile

    import torch.multiprocessing as mp

    if engine == "auto":
        engine = "vllm" if importlib.util.find_spec("vllm") else "replica"
    if num_inference_ranks % inference_tp:
        raise ValueError(f"{num_inference_ranks} ranks are not replicas of tp={inference_tp}")
    if engine == "vllm":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    world = 1 + num_inference_ranks
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        args = (world, store.port, steps, inference_tp, engine, include_unchanged, out)
        mp.start_processes(_rank_main, args=args, nprocs=world, start_method="spawn")
        with open(out) as f:
            return [StepResult(**r) for r in json.load(f)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="inference ranks")
    parser.add_argument("--tp", type=int, default=1, help="inference TP")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements per tensor")
    parser.add_argument("--density", type=float, default=0.03, help="changed fraction")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "replica"])
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    first = {f"t{i}": torch.randn(args.numel, generator=g) for i in range(args.tensors)}
    steps = [{name: w.bfloat16() for name, w in first.items()}]
    for _ in range(args.steps):  # +1 % on a random `density` subset (some round to no change)
        hit = {name: torch.rand(w.shape, generator=g) < args.density for name, w in first.items()}
        steps.append({n: torch.where(hit[n], w * 1.01, w) for n, w in steps[-1].items()})
    print("| step | changed | payload | sent (all ranks) | trainer egress | metadata | s | exact |")
    print("|---|---|---|---|---|---|---|---|")
    for r in run_sparse_nccl(steps, args.ranks, args.tp, args.engine):
        print(
            f"| {r.step} | {r.changed / r.elements:.2%} | {r.payload_bytes / 2**20:.2f} MiB "
            f"| {r.bytes_sent / 2**20:.2f} MiB | {r.busiest_rank_bytes / 2**20:.2f} MiB "
            f"| {r.metadata_bytes} B | {r.seconds:.3f} | {r.bit_exact} |"
        )


if __name__ == "__main__":
    main()
