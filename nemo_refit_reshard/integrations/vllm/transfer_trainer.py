"""The trainer side of vLLM's weight-transfer API: the ``reshard``
``TrainerWeightTransferEngine`` and its ``TrainerInitInfo``.

Built on every trainer rank by ``WeightTransferTrainerFactory.trainer_init(
ReshardTrainerInitInfo(...), client=..., source=...)``. Unlike vLLM's own backends,
where rank 0 gathers and sends everything, here **every trainer rank sends its own
shards**: the refit group is the S trainer ranks followed by the vLLM engine's D workers
(refit rank ``S + engine rank``). Rank 0 is still vLLM's "sender" in one sense: it
alone drives the inference side through the ``VLLMWeightSyncClient``.

Who plans: every trainer rank, alone and identically. The training layouts come from
the source (the same on every rank); the vLLM layout from the init info, which states
the vLLM engine's parallelism and release — the client protocol has no way to ask the
vLLM engine, and each worker checks its slice against its live parameters at init, so a
wrong statement fails there, naming the tensors. The plan is deterministic, but a
rank's source may still differ (its options), so the trainer ranks compare fingerprints
over ``torch.distributed`` before rank 0 ships its slices (``check_same_plan``), and the
group compares them again when it loads the plan.

Phases (rank 0 drives the client; every RPC blocks until all workers answer):

* ``trainer_init``: plan; rank 0 ships the workers the endpoint and the fingerprint
  (``client.init_weight_transfer_engine``: vLLM's ``collective_rpc`` hands every worker
  the same arguments) *in a thread* while it joins the group, puts each worker's plan
  slice in the group's store (``PLAN_KEY``/refit rank: each worker reads its own, and
  only that, after joining) and compiles its own program — joining and loading are
  collective over the whole group, so the RPC returns only once every trainer rank has
  joined too;
* ``send_weights()``: ``start_weight_update``; ``update_weights`` in a thread while
  this rank replays its own program (the workers' replay is the other half of the
  same exchange); then ``finish_weight_update(weight_version)``.

Colocated (``colocated=True``: engine rank ``d`` on the GPU of trainer rank
``colocated_hosts[d]``, default ``d``; ``plan/colocation.py``): the refit group is the
trainer ranks alone; each trainer rank hosts the worker on its GPU, which connects to it
(rank 0 gathers every host's address over ``torch.distributed`` and ships them) and
unpacks the staging it receives into. Same phases, same client calls.
"""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
)

from ...engine.delta import DeltaOptions
from ...engine.rendezvous import (
    Rendezvous,
    broadcast_text,
    gather_texts,
    new_rendezvous,
    publish_texts,
    store_client,
)
from ...engine.transport import DEFAULT_TIMEOUT_S
from ...layouts import VllmOptions
from ...plan import RefitPlan, rank_plan
from ...spec import InferParallel
from ..worker import ColocatedTrainer, RefitEndpoint, RefitWorker
from .engine_plan import plan_for_engine
from .plugin import BACKEND
from .transfer_sources import ReshardSource, check_same_plan


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """What every trainer rank passes to ``trainer_init`` (the same on each, but ``rank``).

    ``vllm_parallel``: the vLLM engine's parallelism (``InferParallel`` fields: tp, pp,
    engine_dp, ep; one vLLM engine per client). ``vllm_version`` / ``params_dtype`` /
    ``all2all_backend``: the vLLM engine's release, parameter dtype and all2all backend
    (``VllmOptions``; None: the installed vLLM, the source's dtype, the default).
    ``host`` / ``port`` / ``secret``: the refit group's rendezvous (``host``: the IP of
    trainer rank 0, which hosts the group's store; reachable from the workers); with
    ``port=None`` rank 0 picks one and shares it (and a new secret) over
    ``torch.distributed`` when there are several trainer ranks. ``transport``:
    ``"gloo"`` or ``"cupy-nccl"``. ``colocated``: every worker shares a GPU with a
    trainer rank (``colocated_hosts[d]`` for engine rank ``d``; default: rank ``d``); the
    group is then the trainer ranks, and several of them need ``torch.distributed`` to
    share their hosts' addresses. ``quantization``: the vLLM engine's
    ``quantization_config`` when it quantizes weights the trainer holds unquantized (an
    FP8 checkpoint's, or the ``hf_overrides`` a framework starts vLLM with): a block-FP8
    one makes trainer ranks send e4m3 + scales where they hold whole blocks
    (``layouts/fp8_wire.py``); any other is refused by name. ``delta``: send each
    message in its smallest form (``engine/delta/program.py``), carried by the endpoint to every
    worker; ``delta_anchor_every`` (a dense update every that many versions, 0: only when
    needed), ``delta_baseline`` (``"auto"``, ``"device"`` or ``"host"``: where trainer
    ranks keep what they sent last; ``"auto"``: the GPU where it fits) and
    ``delta_check`` (each delta's base checked against the workers' weights every step,
    ``engine/delta/check.py``; ``None``: on for GPU ranks) go with it.
    """

    backend: ClassVar[str] = BACKEND

    vllm_parallel: dict[str, int] = field(default_factory=dict)
    vllm_version: str | None = None
    params_dtype: str | None = None
    all2all_backend: str | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    secret: str | None = None
    transport: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S
    connect_timeout_s: float | None = None
    bucket_mb: float = 512
    colocated: bool = False
    colocated_hosts: list[int] | None = None
    quantization: dict[str, Any] | None = None
    delta: bool = False
    delta_anchor_every: int = 0
    delta_baseline: str = "auto"
    delta_check: bool | None = None


def _installed_vllm() -> str:
    import vllm

    return vllm.__version__


PLAN_KEY = "reshard-plan"  # the store key of the workers' plan slices (``PLAN_KEY/rank``)


def _shared_rendezvous(info: ReshardTrainerInitInfo, world: int) -> Rendezvous:
    """The refit group's rendezvous, the same on every trainer rank. ``info.host`` is rank
    0's node's IP: only rank 0 makes the rendezvous there (the others may be on other
    nodes, where it is no address of theirs) and shares it; a port or secret the init
    info sets is kept."""
    if info.port is not None and info.secret is not None:
        return Rendezvous(info.host, info.port, info.secret)
    mine = ""
    if info.rank == 0:
        made = new_rendezvous(info.host, info.port)
        mine = f"{made.port}:{made.secret}"
    if world > 1:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "several trainer ranks with port=None or secret=None: set both in the init "
                "info, or initialise torch.distributed so rank 0 can share them"
            )
        mine = broadcast_text(mine)
    port, secret = mine.split(":")
    return Rendezvous(info.host, int(port), info.secret or secret)


def _endpoint(info: ReshardTrainerInitInfo, world_size: int, trainers: int) -> RefitEndpoint:
    """This trainer rank's endpoint in a refit group of ``world_size`` (rendezvous shared
    by the ``trainers`` ranks, :func:`_shared_rendezvous`)."""
    r = _shared_rendezvous(info, trainers)
    return RefitEndpoint(
        r.ip, r.port, world_size, info.rank, info.transport, info.timeout_s,
        info.connect_timeout_s, r.secret, delta_options(info),
    )  # fmt: skip


def delta_options(info: ReshardTrainerInitInfo) -> DeltaOptions | None:
    """The init info's delta options (None: dense); a non-boolean ``delta`` or a delta
    key set without ``delta=True`` is refused by name."""
    anchor, baseline, check = info.delta_anchor_every, info.delta_baseline, info.delta_check
    if not isinstance(info.delta, bool):
        raise ValueError(f"ReshardTrainerInitInfo.delta={info.delta!r} must be True or False")
    if not info.delta:
        if (anchor, baseline, check) != (0, "auto", None):
            raise ValueError(
                "ReshardTrainerInitInfo.delta_anchor_every / delta_baseline / delta_check "
                "apply to delta refits only; set delta=True, or drop them"
            )
        return None
    if isinstance(anchor, bool) or not isinstance(anchor, int):
        raise ValueError(f"ReshardTrainerInitInfo.delta_anchor_every={anchor!r}: an integer >= 0")
    try:
        return DeltaOptions(anchor_every=anchor, baseline=baseline, check=check)
    except ValueError as err:
        raise ValueError(f"ReshardTrainerInitInfo: {err}") from None


def _payload(
    endpoint: RefitEndpoint, plan: RefitPlan, colocated: list[str] | None = None
) -> dict[str, Any]:
    """What rank 0 ships every worker through ``init_weight_transfer_engine`` (the same to
    each: vLLM's ``collective_rpc``): ``endpoint``, the plan's fingerprint and the store
    key of the plan slices, never a slice (each worker reads its own from the group's
    store); a colocated refit adds ``colocated``, the address each worker's host listens
    on (``ReshardInitInfo``)."""
    payload: dict[str, Any] = {
        "endpoint": endpoint.to_json(),
        "first_rank": plan.num_sources,
        "plan": None,  # each worker reads its own slice from the group's store
        "plan_key": PLAN_KEY,
        "fingerprint": plan.fingerprint,
    }
    if colocated is not None:
        payload["colocated"] = colocated
    return payload


def _publish_slices(endpoint: RefitEndpoint, plan: RefitPlan, ranks: range) -> None:
    """Rank 0: each worker's plan slice in the group's store, under ``PLAN_KEY/rank``."""
    e = endpoint
    store = store_client(
        e.host, e.port, e.connect_timeout_s or e.timeout_s, e.secret, "refit rank 0"
    )
    publish_texts(store, PLAN_KEY, {r: rank_plan(plan, r).to_json() for r in ranks})


def build_plan(info: ReshardTrainerInitInfo, source: ReshardSource) -> RefitPlan:
    """The refit plan from the source's trainer layouts to the stated vLLM engine."""
    options = VllmOptions(
        params_dtype=info.params_dtype,
        vllm_version=info.vllm_version or _installed_vllm(),
        all2all_backend=info.all2all_backend,
    )
    if info.colocated_hosts and not info.colocated:
        raise ValueError("colocated_hosts given but colocated=False: set colocated=True")
    hosts = tuple(info.colocated_hosts or ()) if info.colocated else None
    return plan_for_engine(
        source,
        InferParallel(**info.vllm_parallel),
        options,
        info.bucket_mb,
        info.quantization,
        hosts,
    )


class ReshardTrainerWeightTransferEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """vLLM trainer weight-transfer engine ``reshard``: every trainer rank replays its
    compiled program, sending its local shards straight to the workers' live parameters."""

    init_info_cls = ReshardTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: ReshardSource,
        refit: RefitWorker | ColocatedTrainer,
        plan: RefitPlan,
        is_sender: bool = True,
        rank: int = 0,
    ) -> None:
        super().__init__(client=client, source=None, is_sender=is_sender, rank=rank)
        self.source = source  # ours, not a vLLM WeightSource (see transfer_sources.py)
        self.refit = refit
        self.plan = plan
        self.step = 0

    @classmethod
    def trainer_init(
        cls,
        init_info: ReshardTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: Any = None,
    ) -> ReshardTrainerWeightTransferEngine:
        """Plan, then join the refit group and load the plan with every worker (rank 0
        ships the workers their slices through ``client`` meanwhile)."""
        if not isinstance(source, ReshardSource):
            raise TypeError(
                "the reshard trainer engine sends local shards: pass a MegatronSource, "
                "DTensorSource or FullModuleSource (nemo_refit_reshard.integrations.vllm."
                f"transfer_sources), not {type(source).__name__}"
            )
        if source.rank != init_info.rank:
            raise ValueError(f"source is rank {source.rank}, init info rank {init_info.rank}")
        delta_options(init_info)  # a bad delta option fails before planning
        plan = build_plan(init_info, source)
        check_same_plan(plan.fingerprint, source.world_size)  # before rank 0 ships its slices
        if plan.colocated_hosts:
            return cls._colocated(init_info, client, source, plan)
        s, d = plan.num_sources, plan.num_destinations
        endpoint = _endpoint(init_info, s + d, s)
        refit = RefitWorker(endpoint, source.tensors())
        transfer = cls(
            client=client,
            source=source,
            refit=refit,
            plan=plan,
            is_sender=init_info.is_sender,
            rank=init_info.rank,
        )
        payload = _payload(replace(endpoint, group_rank=s), plan)

        def join_and_load() -> None:
            refit.join()
            if init_info.rank == 0:  # the store is up once rank 0 has joined
                _publish_slices(endpoint, plan, range(s, s + d))
            refit.load_plan(rank_plan(plan, init_info.rank))

        transfer.init_with_workers(payload, join_and_load)
        return transfer

    @classmethod
    def _colocated(
        cls,
        info: ReshardTrainerInitInfo,
        client: VLLMWeightSyncClient,
        source: ReshardSource,
        plan: RefitPlan,
    ) -> ReshardTrainerWeightTransferEngine:
        """``trainer_init`` of a colocated refit: the group is the trainer ranks; each
        hosts the worker on its GPU, which connects to the address rank 0 ships it."""
        s, d = plan.num_sources, plan.num_destinations
        endpoint = _endpoint(info, s, s)
        trainer = ColocatedTrainer(endpoint, source.tensors(), plan)
        try:  # a failed start releases the staging it took (as every failure below)
            mine = trainer.listen() or ""  # the worker shares this GPU: loopback reaches it
            addresses = gather_texts(mine) if s > 1 else [mine]
        except BaseException:
            trainer.close()
            raise
        transfer = cls(
            client=client, source=source, refit=trainer, plan=plan,
            is_sender=info.is_sender, rank=info.rank,
        )  # fmt: skip
        payload = _payload(endpoint, plan, [addresses[h] for h in plan.colocated_hosts])

        def join_and_accept() -> None:
            trainer.join()
            if info.rank == 0:  # the store is up once rank 0 has joined
                _publish_slices(endpoint, plan, range(s, s + d))
            trainer.accept_worker()

        try:
            transfer.init_with_workers(payload, join_and_accept)
        except BaseException:
            trainer.close()
            raise
        return transfer

    def init_with_workers(self, payload: dict[str, Any], local: Any) -> None:
        """Rank 0 ships the workers ``payload`` (``init_weight_transfer_engine``) while
        this rank runs ``local``, its half of the same collective (:meth:`concurrently`)."""
        rpc = lambda: self.client.init_weight_transfer_engine(payload)  # noqa: E731
        self.concurrently(rpc if self.is_sender else None, local)

    def concurrently(self, rpc: Any, local: Any) -> None:
        """Run the blocking client ``rpc`` (rank 0 only) and this rank's ``local`` half of
        the same collective side by side; raise the first failure as soon as it happens
        (a request the workers refuse must not wait for the group's timeout)."""
        if rpc is None:
            local()
            return
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="reshard")
        try:
            futures = [pool.submit(rpc), pool.submit(local)]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                if future in done and future.exception() is not None:
                    raise future.exception()  # type: ignore[misc]
            for future in futures:
                future.result()
        finally:
            # Never join a stuck half: the caller must see the error now; the group is
            # unusable either way and times out on its own.
            pool.shutdown(wait=False)

    def send_weights(self, weight_version: str | None = None) -> None:
        """One full refit, on every trainer rank. Rank 0 drives the workers through
        ``start_weight_update`` -> ``update_weights`` (overlapping this rank's own
        replay) -> ``finish_weight_update(weight_version)`` (default: the step)."""
        self.step += 1
        step = self.step
        version = weight_version if weight_version is not None else str(step)
        if self.is_sender:
            self.client.start_weight_update()
        update = {"step": step, "weight_version": version}
        self.concurrently(
            (lambda: self.client.update_weights(update)) if self.is_sender else None,
            lambda: self.refit.refit(step),
        )
        if self.is_sender:
            self.client.finish_weight_update(weight_version=version)

    def delta_stats(self) -> dict[str, Any] | None:
        """This trainer rank's last delta update (``DeltaStats`` fields: ``sent_bytes``,
        ``dense_bytes``, ``forms``, ...); None without delta."""
        if isinstance(self.refit, ColocatedTrainer):
            delta = self.refit.host.delta
            return asdict(delta.stats) if delta is not None else None
        refitter = self.refit.refitter
        if refitter is None or refitter.delta is None:
            return None
        return asdict(refitter.delta.last)

    def shutdown(self) -> None:
        self.refit.close()


__all__ = ["ReshardTrainerInitInfo", "ReshardTrainerWeightTransferEngine", "build_plan"]
