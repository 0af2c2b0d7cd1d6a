"""``plan_refit``: layouts of both sides in, a :class:`~.result.refit_plan.RefitPlan` out.

Every non-padding element of every destination tensor is delivered exactly once, from
a training rank that holds it. The plan is built by seven passes, each one module (or
package) with one entry function and a typed result you can print::

    needs    = find_needs(spec, sources, destinations)            # 1 pass1_needs.py
    fanout   = plan_fanout(needs, config)                         # 2 pass2_fanout.py
    senders  = choose_senders(needs, fanout, config)              # 3 pass3_senders.py
    routes   = plan_routes(senders, fanout, config, S)            # 4 pass4_routes/
    rounds   = plan_rounds(routes, config)                        # 5 pass5_rounds/
    messages = to_messages(rounds.transfers)                      # 6 pass6_messages.py
    plan     = assemble_plan(spec, sources, destinations, config,
                             needs, routes, messages, choice)     # 7 pass7_assemble.py

``relay="auto"`` with a topology runs passes 2-4 for each candidate relay mode (pass 3
reusing what the mode before it took from the needs alone) and pass 5 only for those
whose routes could still win (``relay_choice.py``).
"""

from __future__ import annotations

from ..layouts.base import RankLayout, paused_gc
from ..layouts.fp8_wire import wire_spec
from ..spec.model import ModelSpec
from ..spec.quantization import FP8
from .base import PlanError
from .cluster import LinkModel
from .colocation import Colocation
from .config import RELAY_CHOICES, PlanConfig
from .pass1_needs import find_needs
from .pass2_fanout import plan_fanout
from .pass3_senders import Senders, choose_senders
from .pass4_routes import Routes, plan_routes
from .pass5_rounds import Rounds, plan_rounds
from .pass6_messages import to_messages
from .pass7_assemble import assemble_plan
from .relay_choice import choose_relay
from .result.refit_plan import RefitPlan


def plan_refit(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    bucket_mb: float = 512,
    destination_spec: ModelSpec | None = None,
    relay: str = "auto",
    links: LinkModel | None = None,
    carry: bool = True,
    colocation: Colocation | None = None,
) -> RefitPlan:
    """Build the transfer plan from every source layout to every destination layout.

    ``relay="chain"`` forwards a box that one training rank would send to several
    inference replicas along a chain of those replicas (``pass4_routes/chain.py``);
    ``relay="domain"`` sends one copy per NVLink domain and forwards it inside
    (``pass2_fanout.py``, ``pass4_routes/domain.py``); ``relay="none"`` sends every
    replica its own copy. ``relay="auto"`` (the default) is ``"none"`` without a
    topology; with one it picks the mode with the lowest predicted time
    (``relay_choice.py``; the plan's ``relay_choice`` says which and why). ``links`` (a
    :class:`~.cluster.Topology`) makes replica choice minimise predicted link busy time
    instead of bytes per sender and schedules rounds by time
    (``pass5_rounds/timed.py``); with it and ``carry``, training ranks busier than their
    NVLink domain's mean hand part of their sending to neighbours, which carry it
    through a relay buffer (``pass4_routes/carry.py``). ``colocation`` (a
    :class:`~.colocation.Colocation`): each inference rank shares its GPU with a training
    rank, which sends it whatever it holds of its needs as a device-local copy
    (``colocation.py``). The settings travel through the passes as one
    :class:`~.config.PlanConfig`. A block-FP8 ``spec`` is planned as it crosses the wire:
    both sides must come from ``layouts.fp8_wire.wire_layouts`` (``refit_layouts`` does
    that), which says which weights training ranks quantize.
    """
    if relay not in RELAY_CHOICES:
        raise PlanError(f"unknown relay mode {relay!r}; choose one of {RELAY_CHOICES}")
    if destination_spec is not None:
        check_specs_match(spec, destination_spec)
    if [lay.rank for lay in sources] != list(range(len(sources))):
        raise PlanError("source layouts must be given for ranks 0..S-1 in order")
    if [lay.rank for lay in destinations] != list(range(len(destinations))):
        raise PlanError("destination layouts must be given for ranks 0..D-1 in order")
    if colocation is not None:
        colocation.check(len(sources), len(destinations))
    config = PlanConfig(int(bucket_mb * 2**20), relay, links, carry, colocation)
    if spec.arch.quant is not None:
        check_wire_layouts(sources, destinations)
    return plan_with(wire_spec(spec, destinations), sources, destinations, config)


@paused_gc
def plan_with(
    spec: ModelSpec, sources: list[RankLayout], destinations: list[RankLayout], config: PlanConfig
) -> RefitPlan:
    """The passes in order (module docstring), for layouts ``plan_refit`` checked."""
    needs = find_needs(spec, sources, destinations)
    earlier: list[Senders] = []  # pass 3 of the mode routed before (its fixed part is reused)

    def route(mode: str) -> Routes:
        """Passes 2-4 for one relay mode."""
        settings = config.with_relay(mode)
        fanout = plan_fanout(needs, settings)
        senders = choose_senders(needs, fanout, settings, *earlier[-1:])
        earlier[:] = [senders]
        return plan_routes(senders, fanout, settings, needs.num_sources)

    def schedule(routes: Routes) -> Rounds:
        """Pass 5."""
        return plan_rounds(routes, config)

    choice = None
    if config.relay == "auto" and config.links is not None:
        choice, routes, rounds = choose_relay(needs, route, schedule, config.links)
    else:
        routes = route(config.mode)
        rounds = schedule(routes)
    messages = to_messages(rounds.transfers)
    return assemble_plan(spec, sources, destinations, config, needs, routes, messages, choice)


def check_wire_layouts(sources: list[RankLayout], destinations: list[RankLayout]) -> None:
    """A block-FP8 engine's e4m3 weights arrive either quantized by a training rank or as
    shadows; live e4m3 destinations fed by unquantizing sources would be cast, unscaled."""
    derived = any(t.fp8 is not None for s in sources for t in s.tensors)
    for d in destinations:
        for t in d.tensors:
            if t.dtype == FP8 and t.pieces and not derived:
                raise PlanError(
                    f"destination rank {d.rank} receives {t.name} as e4m3 but no training "
                    "rank quantizes: build both sides with layouts.fp8_wire.wire_layouts "
                    "(layouts.refit_layouts does)"
                )


def check_specs_match(source: ModelSpec, destination: ModelSpec) -> None:
    """Both sides must describe the same canonical tensors (names and shapes)."""
    problems = []
    src = {t.name: t.shape for t in source}
    dst = {t.name: t.shape for t in destination}
    for name in sorted(set(dst) - set(src)):
        problems.append(f"{name}: only in the destination spec")
    for name in sorted(set(src) - set(dst)):
        problems.append(f"{name}: only in the source spec")
    for name in sorted(set(src) & set(dst)):
        if src[name] != dst[name]:
            problems.append(
                f"{name}: source shape {list(src[name])} != destination {list(dst[name])}"
            )
    if problems:
        raise PlanError.listing(
            f"source spec {source.name!r} and destination spec {destination.name!r} disagree "
            f"on {len(problems)} tensor(s)",
            problems,
        )
