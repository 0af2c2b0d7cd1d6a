"""The Megatron provider against real megatron-core MLA (DeepSeek-V3-like) ``GPTModel``s.

Like ``test_megatron_truth.py`` but for ``TINY_CONFIGS["deepseek_v3"]`` (MLA with
q-LoRA, layer 0 dense, layers 1-2 MoE with 4 routed experts, 1 shared expert and a
router ``expert_bias``), built with the *local* spec
(``get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)`` per layer,
via ``get_gpt_decoder_block_spec`` and ``moe_layer_freq=[0, 1, 1]``) in one spawn of
2 gloo CPU ranks. On every rank, for every configuration:

1. names/shapes: ``state_dict()`` names (parameters + persistent buffers) and shapes
   equal the provider's local tensors; ``parallel_state`` coordinates equal
   ``layout.position``.
2. placement: parameters filled through the provider's pieces with distinct integer
   tags; every ShardedTensor of ``model.sharded_state_dict()`` must sit at the global
   offset the tags imply, and equal the independently built global tensor there
   (``megatron_mla_cpu.mla_global``). Ranks with identical shard sets must be ``layout.replicas``.
3. logits: parameters filled from a random HF ``DeepseekV3ForCausalLM`` checkpoint
   through the pieces; Megatron's forward must match HF's logits. RoPE: HF
   ``rope_interleave=True`` (the DeepSeek default) de-interleaves the rope sub-dims
   (``[0::2 | 1::2]``) before ``rotate_half``; Megatron's ``_apply_rotary_pos_emb_bshd``
   does exactly that whenever ``multi_latent_attention`` is set, so Megatron keeps
   ``rotary_interleaved=False`` and ``rope_type="rope"`` (no YaRN; softmax scale
   ``1/sqrt(qk_nope + qk_rope)`` like HF without ``rope_scaling``).
   Controls: a shared-expert gate/up swap must break parity, and the logits must *not*
   match HF run with ``rope_interleave=False`` (so the RoPE layout is really tested; the
   router ``e_score_correction_bias`` is randomised so that it changes expert choice).
"""

from __future__ import annotations

import os
import tempfile
import traceback
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from nemo_refit_reshard.layouts.megatron import MegatronOptions, megatron_layout
from nemo_refit_reshard.spec.model import spec_from_hf_config
from nemo_refit_reshard.spec.parallel import TrainParallel
from tests.helpers import megatron_cpu as mc
from tests.helpers import megatron_mla_cpu as mla

pytestmark = pytest.mark.slow

WORLD, BATCH, SEQ = 2, 2, 8
P = TrainParallel
# Negative control: fill the shared experts' fc1 with gate and up swapped.
NEG = ("shared_experts", "gate_proj", "up_proj")
CASES: dict[str, P] = {
    "dsv3_tp2": P(tp=2),
    "dsv3_ep2": P(tp=1, ep=2, dp=2),
    "dsv3_tp2_ep2_etp1": P(tp=2, ep=2, etp=1),
}


# ------------------------------------------------------------------------------- workers
def _run_case(rank: int, par: P, payload: dict[str, Any], attn_cls: type) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    hf = payload["hf"]
    spec = spec_from_hf_config(hf)
    arch = spec.arch
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
    )
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(0)
    vocab = mc.padded_vocab(arch.vocab_size, par.tp)
    model = mla.build_mla_gpt(hf, spec, par, vocab, attn_cls)
    params = mc.local_tensors([model], 1)
    layout = megatron_layout(spec, par, rank, MegatronOptions())
    mine = tuple(t for t in layout.tensors if t.name in params and params[t.name].shape == t.shape)
    out: dict[str, Any] = dict(names={n: tuple(p.shape) for n, p in params.items()})
    out["position"] = mc.grid_position()

    tags = mc.tag_tensors(spec)
    mc.fill(params, mine, tags)
    records = []
    records += [
        mc.shard_record(name, st, arch, tags, vocab) for name, st in mc.sharded_tensors([model], 1)
    ]
    out["records"] = records

    ids = payload["inputs"][out["position"]["dp"]]
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    for key, tensors in [("logits", mine), ("negative", mc.swap_pieces(mine, NEG))]:
        mc.fill(params, tensors, payload["canonical"])
        with torch.no_grad():
            local = model(ids, pos, mc.causal_mask(SEQ)).contiguous()  # [b, s, Vp/T]
        parts = [torch.empty_like(local) for _ in range(par.tp)]
        dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
        out[key] = torch.cat(parts, dim=-1)[..., : arch.vocab_size]
    dist.barrier()
    ps.destroy_model_parallel()
    return out


def _worker(rank: int, tmp: str) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    torch.set_num_threads(1)
    mc.apply_cpu_patches()
    attn_cls = mla.cpu_mla_patches()
    # megatron_cpu.megatron_global has no MLA / shared-expert / expert_bias keys; the
    # placement record (megatron_cpu.shard_record) looks it up there.
    mc.megatron_global = mla.mla_global
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/init",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=120),
    )
    payload = torch.load(os.path.join(tmp, "payload.pt"), weights_only=False)
    results = {}
    for name, par in CASES.items():
        try:
            results[name] = _run_case(rank, par, payload, attn_cls)
        except Exception as e:
            raise RuntimeError(f"rank {rank}, config {name}:\n{traceback.format_exc()}") from e
    torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- parent
@pytest.fixture(scope="module")
def truth() -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    from tests.helpers.hf_models import checkpoint_state_dict, hf_config_dict, random_hf_model

    for name, par in CASES.items():
        assert par.world_size == WORLD, name
    model = random_hf_model("deepseek_v3", 0)
    # Random e_score_correction_bias (a buffer, so random_hf_model leaves it at zero): makes
    # the bias change the expert choice, so a misplaced bias shows in the logits.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.5 * torch.randn(buf.shape, generator=gen))
    hf = hf_config_dict(model)
    canonical = checkpoint_state_dict(model)
    spec_names = [t.name for t in spec_from_hf_config(hf)]
    assert sorted(canonical) == sorted(spec_names), "checkpoint names != ModelSpec names"
    inputs = torch.randint(0, hf["vocab_size"], (WORLD, BATCH, SEQ), generator=gen)
    with torch.no_grad():
        ref = torch.stack([model(input_ids=ids).logits for ids in inputs])
        # RoPE control: HF without the rope de-interleave (read at forward time).
        model.config.rope_interleave = False
        plain = torch.stack([model(input_ids=ids).logits for ids in inputs])
    payload = dict(hf=hf, canonical=canonical, inputs=inputs, reference=ref, plain_rope=plain)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(payload, os.path.join(tmp, "payload.pt"))
        mp.start_processes(_worker, args=(tmp,), nprocs=WORLD, start_method="spawn")
        results = {r: torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)}
    return payload, results


def _layouts(name: str, payload: dict[str, Any]) -> list:
    spec = spec_from_hf_config(payload["hf"])
    return [megatron_layout(spec, CASES[name], r, MegatronOptions()) for r in range(WORLD)]


@pytest.mark.parametrize("name", list(CASES))
def test_names_shapes_and_position(truth, name: str) -> None:
    payload, results = truth
    mc.assert_names_shapes_position(name, _layouts(name, payload), results)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_state_dict_placement(truth, name: str) -> None:
    payload, results = truth
    mc.assert_placement(name, _layouts(name, payload), results)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(truth, name: str) -> None:
    payload, results = truth
    for rank in range(WORLD):
        res = results[rank][name]
        got, want = res["logits"], payload["reference"][res["position"]["dp"]]
        torch.testing.assert_close(
            got, want, atol=1e-4, rtol=1e-4, msg=lambda m, r=rank: f"{name} rank {r}: {m}"
        )


@pytest.mark.parametrize("name", list(CASES))
def test_negative_controls_differ(truth, name: str) -> None:
    """A gate/up swap in the shared experts must break parity, and Megatron's MLA RoPE
    must not also match HF with ``rope_interleave=False`` (so RoPE layout is tested)."""
    payload, results = truth
    for rank in range(WORLD):
        res = results[rank][name]
        dp = res["position"]["dp"]
        diff = (res["negative"] - payload["reference"][dp]).abs().max().item()
        assert diff > 1e-2, f"{name} rank {rank}: corrupted pieces {NEG} still match"
        diff = (res["logits"] - payload["plain_rope"][dp]).abs().max().item()
        assert diff > 1e-2, f"{name} rank {rank}: matches HF without rope_interleave too"
