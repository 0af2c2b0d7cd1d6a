"""A CPU SGLang 0.5.23 HTTP server for tests: what ``sglang.srt.entrypoints.http_server.
launch_server`` runs (HTTP front, tokenizer manager, one scheduler per tp rank), built
from SGLang's own classes where they run on CPU (run under ``.venv-sglang``'s Python).

    python -m tests.programs.sglang_http_stand_in JOB.json

JOB: ``{"model_dir": a directory with an HF config.json, "name": the spec name,
"config": that config dict, "tp": int, "initial": a safetensors file SGLang loads at
start-up, "server_args": NeMo RL's SGLangGenerationWorker._compute_server_args dict
(read: "host", "port", "tp_size" (must equal "tp"), "custom_weight_loader" (absent:
[])), "gpus": one device name per tp rank, optional "authkey": hex of the sender's
``multiprocessing`` authkey}``. The authkey lets a rank fetch the file descriptor of a
non-empty CPU tensor the sender pickled (``ForkingPickler``'s ``DupFd``: same node,
sender alive, same authkey; a refit command's empty tensor pickles inline). Each tp
rank is a spawned process that sets ``NRR_DEVICE`` (``DEVICE_ENV``) to its ``gpus``
entry first, builds the model (``tests/helpers/sglang_cpu.build_model``), loads
``initial`` with the model's ``load_weights`` and builds the scheduler's weight-update
manager (``tests/helpers/sglang_scheduler.scheduler_weight_updater``). The port listens
once every rank is ready. Routes, answered as SGLang's ``http_server.py`` answers them:
``/health_generate`` (and ``/health``), ``/flush_cache``, ``/release_memory_occupation``,
``/resume_memory_occupation``, ``/begin_weight_update``, ``/end_weight_update``,
``/update_weights_from_tensor`` (others: 404 ``{"detail": "Not Found"}``); and the
tests' own ``POST /nrr_test/report {"checkpoint": safetensors path}`` -> ``{"ranks":
[per rank :func:`_report`], "events": [{"path", and those of "tags", "load_format",
"weight_version", "flush_cache" the request has}, ...] (every valid request but health
and ``/nrr_test/*``, in order), "versions": [per rank, the weight versions SGLang
recorded]}`` and ``POST /nrr_test/shutdown`` -> ``{"success", "exitcodes", "error"}``,
then exit (0 when every rank exited 0).

SGLang's own code here: the model classes, SGLang's runtime context and parallel state
over gloo (``sglang_cpu.build_model``); ``SchedulerWeightUpdaterManager`` and
``WeightUpdater`` (session checks, ``update_weights_from_tensor``, weight-version
recording, ``post_load_weights`` at ``end_weight_update``); the ``io_struct`` request
classes, validated from the JSON body by their own pydantic schema as FastAPI validates
them; ``normalize_serialized_named_tensor_payloads`` (the tokenizer manager's step);
``MultiprocessingSerializer`` and its ``SafeUnpickler`` with SGLang's torch-reduction
patch (``deserialize_own_rank``); ``HookRegistry`` applying our plugin's hook.

Stand-ins (SGLang code that cannot run on CPU, and what replaces it):

- FastAPI front and ``TokenizerManager`` (tokenizer, detokenizer, ZMQ fan-out): a stdlib
  ``ThreadingHTTPServer`` that validates each body into SGLang's request struct and
  sends it to every rank over a multiprocessing queue, one request at a time under a
  lock (as the tokenizer manager's ``model_update_lock`` serializes weight updates),
  waiting as long as the ranks take. The answer is ``success`` if every rank succeeded,
  with the first failing rank's message, else rank 0's (SGLang returns tp rank 0's
  answer), plus the tokenizer manager's " Weight version updated to V." suffix.
  ``/flush_cache``, ``/release_memory_occupation`` and ``/resume_memory_occupation``
  are recorded only: no radix cache, no KV cache or GPU memory on CPU.
  ``/health_generate`` generates no token (no forward pass on CPU): 200 once ranks are
  ready, 503 after a rank died.
- The ``Scheduler`` process (ZMQ, dispatcher, radix cache): each rank process calls the
  manager's handlers directly; ``record_weight_version_change`` appends to a list and
  ``flush_cache`` has nothing to flush. A rank's exception (a real scheduler would end
  the server) answers 500 naming the rank, as does a rank process that died; after
  either the server answers 500 (health: 503) until shut down.
- ``ModelRunner`` (KV cache, CUDA graphs) and ``TpModelWorker``: namespaces holding what
  the tensor path reads — SGLang's own ``WeightUpdater`` built as
  ``ModelRunner.init_weight_updater`` builds it, with ``server_args
  ["custom_weight_loader"]`` in ``custom_weight_loaders`` as ``--custom-weight-loader``
  puts it (callbacks the path never calls raise), and ``deserialize_own_rank`` copied
  line for line (its module imports the scheduler, which needs ``setproctitle``, absent
  from the CPU venv).
- ``load_plugins()``: each rank calls ``plugin.register()`` and
  ``HookRegistry.apply_hooks()``.
- ``torchvision`` and vLLM's CUDA rotary kernel: ``tests/helpers/sglang_cpu.py``.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import torch.multiprocessing as mp

FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
# path -> (methods, the rank operation it forwards or None, the io_struct class name)
ROUTES: dict[str, tuple[tuple[str, ...], str | None, str | None]] = {
    "/health": (("GET",), None, None),
    "/health_generate": (("GET",), None, None),
    "/flush_cache": (("GET", "POST"), None, None),
    "/release_memory_occupation": (("GET", "POST"), None, "ReleaseMemoryOccupationReqInput"),
    "/resume_memory_occupation": (("GET", "POST"), None, "ResumeMemoryOccupationReqInput"),
    "/begin_weight_update": (("POST",), "begin", "BeginWeightUpdateReqInput"),
    "/end_weight_update": (("POST",), "end", "EndWeightUpdateReqInput"),
    "/update_weights_from_tensor": (("POST",), "update", "UpdateWeightsFromTensorReqInput"),
    "/nrr_test/report": (("POST",), "report", None),
    "/nrr_test/shutdown": (("POST",), "shutdown", None),
}
EVENT_FIELDS = ("tags", "load_format", "weight_version", "flush_cache")


def _rank_main(job: dict[str, Any], rank: int, port: int, inbox: Any, outbox: Any) -> None:
    """One tp rank: SGLang's scheduler-side state, then requests until shutdown."""
    from nemo_refit_reshard.integrations.worker import DEVICE_ENV

    os.environ[DEVICE_ENV] = job["gpus"][rank]  # before anything reads it
    try:
        state = _rank_start(job, rank, port)
    except BaseException as err:  # noqa: BLE001 - reported to the server
        outbox.put((-1, rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        return
    outbox.put((-1, rank, True, "ready"))
    while True:
        seq, op, request = inbox.get()
        try:
            answer = _rank_handle(state, op, request)
        except BaseException as err:  # noqa: BLE001 - reported to the server
            tb = traceback.format_exc()
            outbox.put((seq, rank, False, f"{type(err).__name__}: {err}\n{tb}"))
            continue
        outbox.put((seq, rank, True, answer))
        if op == "shutdown":
            return


def _rank_start(job: dict[str, Any], rank: int, port: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    from tests.helpers.sglang_cpu import build_model
    from tests.helpers.sglang_scheduler import scheduler_weight_updater

    model = build_model(job["model_dir"], job["tp"], rank, port)
    model.load_weights(iter(load_file(job["initial"]).items()))  # SGLang's start-up load
    loaders = job["server_args"].get("custom_weight_loader") or []
    manager, versions = scheduler_weight_updater(model, rank, loaders)
    params = dict(model.named_parameters())
    pointers = {n: p.data_ptr() for n, p in params.items()}
    return dict(model=model, manager=manager, versions=versions, job=job, rank=rank,
                params=params, pointers=pointers)  # fmt: skip


def _rank_handle(state: dict[str, Any], op: str, request: Any) -> dict[str, Any]:
    """What the scheduler's dispatcher does with ``request`` on this rank."""
    m = state["manager"]
    handlers = dict(begin=m.begin_weight_update, end=m.end_weight_update,
                    update=m.update_weights_from_tensor)  # fmt: skip
    if op in handlers:
        out = handlers[op](request)
        return {"success": out.success, "message": out.message}
    if op == "report":
        return {**_report(state, request["checkpoint"]), "versions": list(state["versions"])}
    if op == "shutdown":
        return {"exiting": True}
    raise ValueError(f"unknown operation {op!r}")


def _report(state: dict[str, Any], checkpoint: str) -> dict[str, Any]:
    """This rank's parameters against the canonical tensors in ``checkpoint``:
    ``differ`` (pieces not bitwise equal to their canonical slices), ``moved`` (storage
    changed since start-up), ``status`` (``refit_status``), ``derived_differ`` (derived
    tensors unlike what SGLang's own ``load_weights`` + ``post_load_weights`` make of
    ``checkpoint``; the reload runs on the live model, and every parameter and derived
    tensor is then put back as it was, values and storage)."""
    import torch
    from safetensors.torch import load_file

    from nemo_refit_reshard.engine.materialize import mismatches
    from nemo_refit_reshard.integrations.sglang import refit_status
    from nemo_refit_reshard.layouts.sglang import sglang_layout
    from nemo_refit_reshard.spec import InferParallel, spec_from_hf_config
    from tests.helpers.sglang_scheduler import derived_tensors

    job, model, params = state["job"], state["model"], state["params"]
    spec = spec_from_hf_config(job["config"], name=job["name"])
    layout = sglang_layout(spec, InferParallel(tp=job["tp"]), state["rank"], "float32")
    canonical = load_file(checkpoint)
    out = {
        "differ": mismatches(layout, params, canonical),
        "moved": [n for n, p in params.items() if p.data_ptr() != state["pointers"][n]],
        "status": refit_status(model),
        "derived_differ": [],
    }
    derived = derived_tensors(model)
    if derived:
        with torch.no_grad():
            kept = {n: p.detach().clone() for n, p in params.items()}
            kept_derived = {n: t.clone() for n, t in derived.items()}
            model.load_weights(iter(canonical.items()))  # runs post_load_weights itself
            reloaded = derived_tensors(model)
            out["derived_differ"] = [
                n for n, t in kept_derived.items() if not torch.equal(t, reloaded[n])
            ]
            for n, p in params.items():
                p.data.copy_(kept[n])
            for n, t in derived.items():  # the start-up objects, in case SGLang rebound
                module, _, attr = n.rpartition(".")
                setattr(model.get_submodule(module), attr, t)
                t.copy_(kept_derived[n])
    return out


class _Ranks:
    """The scheduler processes and the tokenizer manager's side of their queues."""

    def __init__(self, job: dict[str, Any]) -> None:
        from nemo_refit_reshard.engine.rendezvous import free_port

        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(job["tp"])]
        port = free_port()  # the ranks' gloo world
        self.procs = [
            ctx.Process(target=_rank_main, args=(job, r, port, box, self.outbox))
            for r, box in enumerate(self.inboxes)
        ]
        self.seq = 0
        self.broken: str | None = None  # why every later request fails
        for p in self.procs:
            p.start()

    def collect(self, seq: int) -> list[Any]:
        """Every rank's answer to ``seq`` (-1: start-up), however long they take; raises
        RuntimeError naming the first rank that failed or died (and keeps it: broken)."""
        answers: dict[int, Any] = {}
        while len(answers) < len(self.procs) and self.broken is None:
            try:
                got_seq, rank, ok, value = self.outbox.get(timeout=1.0)
            except queue.Empty:
                self.broken = self.dead(skip=answers)
                continue
            if got_seq == seq and not ok:  # a peer's death shows here as a gloo error
                self.broken = self.dead() or f"SGLang stand-in tp rank {rank} failed: {value}"
            elif got_seq == seq:  # else a late answer to a request that already failed
                answers[rank] = value
        if self.broken is not None:
            raise RuntimeError(self.broken)
        return [answers[r] for r in range(len(self.procs))]

    def dead(self, skip: Any = ()) -> str | None:
        """Names the first rank process that has exited (but not one in ``skip``)."""
        for r, p in enumerate(self.procs):
            if r not in skip and not p.is_alive():
                return f"SGLang stand-in tp rank {r} (pid {p.pid}) exited: {p.exitcode}"
        return None

    def call(self, op: str, request: Any) -> list[Any]:
        self.broken = self.broken or self.dead()
        if self.broken is None:
            self.seq += 1
            for box in self.inboxes:
                box.put((self.seq, op, request))
        return self.collect(self.seq)

    def stop(self) -> list[int | None]:
        """Join every rank (killing one still running 60 s after its answer)."""
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
        return [p.exitcode for p in self.procs]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], ranks: _Ranks) -> None:
        super().__init__(address, _Handler)
        self.ranks = ranks
        self.lock = threading.Lock()  # one request at a time reaches the ranks
        self.events: list[dict[str, Any]] = []
        self.exit_code = 0


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        if "/health" not in self.path:
            sys.stderr.write(f"sglang stand-in: {format % args}\n")

    def do_GET(self) -> None:
        self._route(self.command)

    do_POST = do_PUT = do_DELETE = do_GET

    def _send(self, status: int, body: Any, text: bool = False) -> None:
        data = (body if text else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _route(self, method: str) -> None:
        path = urlsplit(self.path).path
        if path not in ROUTES:
            return self._send(404, {"detail": "Not Found"})
        methods, op, struct = ROUTES[path]
        if method not in methods:
            return self._send(405, {"detail": "Method Not Allowed"})
        if path in ("/health", "/health_generate"):  # every rank is up: we listen
            down = self.server.ranks.broken or self.server.ranks.dead()
            return self._send(503 if down else 200, "", text=True)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        with self.server.lock:
            self._locked(path, op, struct, raw)

    def _locked(self, path: str, op: str | None, struct: str | None, raw: bytes) -> None:
        from pydantic import TypeAdapter, ValidationError
        from sglang.srt.managers import io_struct
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError as err:
            detail = [{"type": "json_invalid", "loc": ["body", err.pos], "msg": err.msg}]
            return self._send(422, {"detail": detail})
        request: Any = body
        if struct is not None and body is None:  # FastAPI: a required Body() is missing
            missing = {"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}
            return self._send(422, {"detail": [missing]})
        if struct is not None:
            try:
                request = TypeAdapter(getattr(io_struct, struct)).validate_python(body)
            except ValidationError as err:
                return self._send(422, {"detail": json.loads(err.json(include_url=False))})
        event: dict[str, Any] = {"path": path}
        for field in EVENT_FIELDS:
            if struct is not None and hasattr(request, field):
                event[field] = getattr(request, field)
        if not path.startswith("/nrr_test/"):
            self.server.events.append(event)
        ranks = self.server.ranks
        if op is None:  # recorded only: nothing to flush, release or resume on CPU
            if ranks.broken:
                return self._send(500, {"detail": ranks.broken})
            if path == "/flush_cache":
                return self._send(200, FLUSHED, text=True)
            return self._send(200, None)  # FastAPI's answer to a handler returning None
        if op == "update":
            request.serialized_named_tensors = normalize_serialized_named_tensor_payloads(
                request.serialized_named_tensors
            )  # the tokenizer manager's step
        if op == "report" and not (isinstance(body, dict) and "checkpoint" in body):
            return self._send(422, {"detail": 'body must be {"checkpoint": path}'})
        if op == "shutdown":
            return self._shutdown(ranks)
        try:
            answers = ranks.call(op, request)
        except RuntimeError as err:
            return self._send(500, {"detail": str(err)})
        if op == "report":
            versions = [a.pop("versions", None) for a in answers]
            return self._send(
                200, {"ranks": answers, "events": self.server.events, "versions": versions}
            )
        failed = [a for a in answers if not a["success"]]
        success, message = not failed, (failed or answers)[0]["message"]
        if op == "update" and success and request.weight_version is not None:
            message += f" Weight version updated to {request.weight_version}."
        return self._send(200 if success else 400, {"success": success, "message": message})

    def _shutdown(self, ranks: _Ranks) -> None:
        """Every rank leaves its loop and exits; then the HTTP server stops (exit code 0
        if every rank exited 0 and none failed before)."""
        error = ranks.broken
        if error is None:
            try:
                ranks.call("shutdown", None)
            except RuntimeError as err:
                error = str(err)
        if error is not None:  # a rank may wait in a barrier forever
            for p in ranks.procs:
                p.kill()
        codes = ranks.stop()
        self.server.exit_code = 0 if error is None and codes == [0] * len(codes) else 1
        self._send(200, {"success": error is None, "exitcodes": codes, "error": error})
        threading.Thread(target=self.server.shutdown, daemon=True).start()


def main(job_path: str) -> int:
    from tests.helpers.sglang_cpu import stub_rotary_kernel, stub_torchvision

    job = json.load(open(job_path))
    args = job["server_args"]
    assert args.get("tp_size", 1) == job["tp"] == len(job["gpus"]), (args, job["tp"])
    stub_torchvision()  # the front validates bodies with SGLang's io_struct
    stub_rotary_kernel()
    import sglang.srt.managers.io_struct  # noqa: F401 - slow: before the port listens

    if job.get("authkey"):  # the ranks inherit it (spawn)
        mp.current_process().authkey = bytes.fromhex(job["authkey"])
    ranks = _Ranks(job)
    try:
        ranks.collect(-1)
    except RuntimeError as err:
        print(f"sglang stand-in: start-up failed: {err}", file=sys.stderr)
        for p in ranks.procs:
            p.kill()
        return 1
    host = str(args.get("host") or "127.0.0.1").strip("[]")
    server = _Server((host, int(args["port"])), ranks)
    print(f"sglang stand-in: listening on {host}:{args['port']}", file=sys.stderr, flush=True)
    server.serve_forever()
    server.server_close()
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
