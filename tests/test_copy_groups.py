"""``CopyGroups`` (engine/phase.py): a phase's copies split once into the lists that
``torch._foreach_copy_`` runs on its multi-tensor path, the rest apart; the same bytes
as one ``copy_`` per pair."""

from __future__ import annotations

import torch

from nemo_refit_reshard.engine.phase import CopyGroups, CopyPhase


def _pairs():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 8, generator=g)
    dst_bf16 = torch.empty(40, dtype=torch.bfloat16)
    dst_f32 = torch.empty(30)
    return [
        (dst_bf16[:10], torch.randn(10, generator=g).bfloat16()),  # fast, bf16
        (dst_f32[:10], torch.randn(10, generator=g)),  # fast, f32
        (dst_bf16[10:20], torch.randn(10, generator=g)),  # a cast
        (dst_f32[10:22].view(6, 2), wide[:, :2]),  # strided source
        (dst_bf16[20:30], torch.randn(10, generator=g).bfloat16()),  # fast, bf16
        (dst_f32[22:30].view(2, 4), torch.randn(2, 4, generator=g)),  # fast, f32
    ]


def test_fast_pairs_grouped_by_dtype_the_rest_apart() -> None:
    pairs = _pairs()
    groups = CopyGroups.of(pairs)
    # as integers of their width: the bits move, NaN payloads included
    assert [[d.dtype for d in dsts] for dsts, _ in groups.fast] == [
        [torch.int16, torch.int16],
        [torch.int32, torch.int32],
    ]
    assert [d.data_ptr() for d in groups.fast[0][0]] == [
        pairs[0][0].data_ptr(),
        pairs[4][0].data_ptr(),
    ]
    assert [d.data_ptr() for d, _ in groups.rest] == [
        pairs[2][0].data_ptr(),
        pairs[3][0].data_ptr(),
    ]
    assert groups.launches == 2 + 2


def test_grouped_copies_write_what_copy_writes() -> None:
    pairs = _pairs()
    nans = torch.tensor([0x7FC1, -0x3F], dtype=torch.int16)  # NaNs with payloads
    pairs[0][1].view(torch.int16)[3:5] = nans
    want = [d.clone().copy_(s) for d, s in pairs]
    phase = CopyPhase(copies_in=pairs)
    phase.unpack()
    assert all(
        torch.equal(d.view(torch.uint8), w.view(torch.uint8)) for (d, _), w in zip(pairs, want)
    )
    assert torch.equal(pairs[0][0].view(torch.int16)[3:5], nans)
    assert phase.launches == 4


def test_a_list_that_grew_is_grouped_again() -> None:
    pairs = _pairs()
    phase = CopyPhase(copies_out=pairs[:2])
    assert phase.launches == 2
    phase.copies_out.append(pairs[2])
    assert phase.launches == 3


def test_a_list_replaced_is_grouped_again() -> None:
    """A phase rebound to other views (tests/test_pipeline.py's negative control does)
    copies through the new views, not the groups of the old list."""
    pairs = _pairs()
    phase = CopyPhase(copies_in=pairs[:2])
    assert phase.launches == 2
    target = torch.zeros(10, dtype=torch.bfloat16)
    source = torch.ones(10, dtype=torch.bfloat16)
    phase.copies_in = [(target, source), pairs[1]]
    phase.unpack()
    assert torch.equal(target, source)
