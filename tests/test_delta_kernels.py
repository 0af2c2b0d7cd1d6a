"""engine/delta/kernels.py: the compiled CPU path gives the numpy path's bytes exactly —
the changed units, the ``GAPS`` payload, the baseline it leaves, the decoded indices and
the receiver's scattered elements — for runs read where they live (strided rows
included), at every pattern the codec's tests use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_refit_reshard.engine.delta import DeltaOptions
from nemo_refit_reshard.engine.delta import kernels as delta_kernels
from nemo_refit_reshard.engine.delta.codec import (
    GAPS,
    MAX_GAP,
    Header,
    changed_units,
    count_long_gaps,
    decode,
    encode,
)

needs_numba = pytest.mark.skipif(not delta_kernels.AVAILABLE, reason="numba is not installed")
INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _patterns(units: int) -> dict[str, list[int]]:
    """Changed unit positions of a message of ``units`` units."""
    return {
        "none": [],
        "all": list(range(units)),
        "one": [units // 2],
        "first": [0],
        "last": [units - 1],
        "every other": list(range(0, units, 2)),
        "far apart": [3, 3 + MAX_GAP, 4 + MAX_GAP, 5 + 3 * MAX_GAP, units - 1],  # long gaps
        "block edges": [63, 64, 127, 128, units - 2],
    }


def _live_rows(units: int, unit: int, row_units: int, g: torch.Generator) -> torch.Tensor:
    """A live tensor whose elements are ``units`` ``unit``-byte units as rows of
    ``row_units``, every row inside a wider row (strided, as a shard's columns)."""
    rows = units // row_units
    wide = torch.randint(-100, 100, (rows, row_units + 7), dtype=INTS[unit], generator=g)
    return wide[:, 3 : 3 + row_units]


def _numpy_path(live: torch.Tensor, baseline: torch.Tensor, unit: int):
    """The numpy path: pack, compare, encode ``GAPS``; (payload bytes, count, long gaps)."""
    packed = live.contiguous().view(torch.uint8).reshape(-1)
    index = changed_units(packed, baseline, unit)
    out = torch.empty(packed.numel() * 2 + 16, dtype=torch.uint8)
    payload = encode(packed, index, unit, GAPS, out).clone()
    return payload, index.numel(), count_long_gaps(index)


@needs_numba
@pytest.mark.parametrize("unit", [1, 2, 4])
@pytest.mark.parametrize("row_units", [64, 100, 5])  # a block, not a block, under a block
def test_the_kernel_finds_and_encodes_exactly_what_numpy_does(unit: int, row_units: int) -> None:
    g = torch.Generator().manual_seed(unit * 1000 + row_units)
    units = row_units * -(-1000 // row_units)  # past 3 long gaps
    for name, changed in _patterns(units).items():
        live = _live_rows(units, unit, row_units, g)
        packed = live.contiguous().view(torch.uint8).reshape(-1)
        flat = live.contiguous().view(INTS[unit]).reshape(-1).clone()
        flat[changed] = flat[changed] + 1  # (int8 wraps: still a change of bits)
        baseline = flat.view(torch.uint8).clone()
        expected, k, e = _numpy_path(live, baseline, unit)
        # the kernel reads the live rows where they are, against its own baseline copy
        base = baseline.clone()
        values = torch.empty(units * unit, dtype=torch.uint8)
        gaps = np.empty(units, dtype=np.uint8)
        longs = np.empty(units // 256 + 1, dtype=np.uint32)
        offset, rows, r_units, stride = delta_kernels.rows_of(live, unit)
        run = (delta_kernels.unit_storage(live, unit), offset, rows, r_units, stride, 0)
        np_base = base.numpy().view(delta_kernels.np_int(unit))
        np_values = values.numpy().view(delta_kernels.np_int(unit))
        count, long_gaps = delta_kernels.compare_runs([run], np_base, np_values, gaps, longs)
        assert (count, long_gaps) == (k, e) == (len(changed), e), name
        got = torch.cat(
            [
                values[: count * unit],
                torch.from_numpy(gaps[:count].copy()),
                torch.from_numpy(longs[:long_gaps].view(np.uint8).copy()),
            ]
        )
        assert torch.equal(got, expected), name
        assert torch.equal(base, packed), name  # the baseline is the message now
        index = delta_kernels.ungap(gaps[:count], longs[:long_gaps])
        assert index.tolist() == changed, name


@needs_numba
def test_bits_not_floats_decide_what_changed() -> None:
    """-0.0 against 0.0 and NaNs with other payloads change; equal bits do not."""
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0] * 40, dtype=torch.bfloat16)
    cur = base.clone()
    cur[0] = -0.0
    cur.view(torch.int16)[2] = base.view(torch.int16)[2] + 1  # another NaN payload
    baseline = base.view(torch.uint8).clone()
    values = np.empty(160, np.int16)
    gaps, longs = np.empty(160, np.uint8), np.empty(2, np.uint32)
    run = (delta_kernels.unit_storage(cur, 2), 0, 1, 160, 160, 0)
    count, _ = delta_kernels.compare_runs(
        [run], baseline.numpy().view(np.int16), values, gaps, longs
    )
    assert count == 2 and gaps[:2].tolist() == [1, 2]
    assert torch.equal(baseline, cur.view(torch.uint8))


@needs_numba
def test_several_runs_continue_one_message_and_the_values_stop_at_their_room() -> None:
    """Runs of two tensors make one message (gaps run across them); values past the
    room given are not written, the gaps still are."""
    g = torch.Generator().manual_seed(1)
    a = _live_rows(300, 2, 100, g)
    b = torch.randint(-9, 9, (40, 10), dtype=torch.int16, generator=g).t()  # not rows
    assert delta_kernels.rows_of(b, 2) is None
    c = torch.randint(-9, 9, (2, 3, 50), dtype=torch.int16, generator=g)  # collapses
    assert delta_kernels.rows_of(c, 2) == (0, 1, 300, 300)
    message = torch.cat([a.reshape(-1), c.reshape(-1)]).view(torch.uint8)
    baseline = message.clone()
    baseline.view(torch.int16)[[5, 299, 300, 599]] += 1
    runs = [
        (delta_kernels.unit_storage(a, 2), *delta_kernels.rows_of(a, 2), 0),
        (delta_kernels.unit_storage(c, 2), *delta_kernels.rows_of(c, 2), 300),
    ]
    values, gaps = np.zeros(3, np.int16), np.empty(600, np.uint8)
    longs = np.empty(3, np.uint32)
    count, long_gaps = delta_kernels.compare_runs(
        runs, baseline.numpy().view(np.int16), values, gaps, longs
    )
    assert (count, long_gaps) == (4, 2)
    assert gaps[:4].tolist() == [6, 0, 1, 0] and longs[:2].tolist() == [294, 299]
    assert delta_kernels.ungap(gaps[:4], longs[:2]).tolist() == [5, 299, 300, 599]
    assert values.tolist() == message.view(torch.int16)[[5, 299, 300]].tolist()
    assert torch.equal(baseline, message)


@needs_numba
@pytest.mark.parametrize("shape, view", [((6, 40), (slice(None), slice(8, 30))), ((300,), None)])
def test_the_compiled_scatter_writes_what_numpy_writes(shape, view) -> None:
    """Into a shard's columns (strided rows) and a whole tensor: the elements numpy's
    scatter (``delta.rounds._scatter``) writes, and nothing else."""
    from nemo_refit_reshard.engine.delta.rounds import _scatter

    g = torch.Generator().manual_seed(2)
    whole = torch.randint(-50, 50, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
    expected = whole.clone()
    live, twin = (whole[view], expected[view]) if view else (whole, expected)
    n = live.numel()
    index = torch.tensor(sorted({0, 1, 63, 64, n // 2, n - 1}), dtype=torch.int64)
    values = torch.randint(-9, 9, (index.numel(),), dtype=torch.int16, generator=g)
    _scatter(twin, index, values.view(torch.uint8))
    target = delta_kernels.scatter_target(live)
    delta_kernels.scatter(target, (index + 10).numpy(), 10, values.numpy())
    assert torch.equal(whole.view(torch.int16), expected.view(torch.int16))


@needs_numba
def test_a_compiled_decode_refuses_what_the_numpy_decode_refuses() -> None:
    """Long gaps that are not the zero gap bytes' values: the same error both ways."""
    # 2 one-byte values, gaps [7, 1]... then bytes that are not a long gap's uint32
    payload = torch.tensor([7, 7, 7, 1, 0, 0, 0, 9], dtype=torch.uint8)
    errors = []
    for compiled in (False, True):
        with pytest.raises(ValueError) as err:
            decode(payload[:-1], Header(GAPS, 0, 2, 7), 64, 1, compiled)
        errors.append(str(err.value))
    assert errors[0] == errors[1]
    index, values = decode(payload[:4], Header(GAPS, 0, 2, 4), 64, 1, True)
    assert index.tolist() == [6, 7] and values.tolist() == [7, 7]
    assert decode(payload[:4], Header(GAPS, 0, 2, 4), 64, 1, False)[0].tolist() == [6, 7]


def test_the_kernel_choice_is_checked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"cpu_kernel='fast': choose one of"):
        DeltaOptions(cpu_kernel="fast")
    monkeypatch.setattr(delta_kernels, "AVAILABLE", False)
    with pytest.raises(ValueError, match=r"numba is not installed: pip install"):
        DeltaOptions(cpu_kernel="numba")
    assert not delta_kernels.use_numba("auto")  # the numpy path, said by DeltaStats
    assert DeltaOptions(cpu_kernel="numpy").cpu_kernel == "numpy"
    assert delta_kernels.MAX_GAP == MAX_GAP


def _gaps_of(index: list[int]) -> tuple[np.ndarray, np.ndarray]:
    gaps = np.diff(np.array(index, dtype=np.int64), prepend=-1)
    short = gaps.astype(np.uint8)
    short[gaps > MAX_GAP] = 0
    return short, gaps[gaps > MAX_GAP].astype(np.uint32)


@needs_numba
def test_gaps_scatter_straight_into_the_runs_or_refuse_a_unit_outside_them() -> None:
    """One pass from gap bytes into two runs (a strided one, then a whole tensor):
    the elements ``ungap`` + ``scatter`` write; a changed unit in a hole between the
    runs or past the last is refused, not written somewhere."""
    g = torch.Generator().manual_seed(3)
    wide = torch.zeros(4, 300, dtype=torch.int16)
    a, b = wide[:, 10:280], torch.zeros(500, dtype=torch.int16)  # units [0, 1080), [1100, 1600)
    runs = [
        (delta_kernels.scatter_target(a), 0, 1080),
        (delta_kernels.scatter_target(b), 1100, 1600),
    ]
    index = [0, 269, 270, 700, 1079, 1100, 1101, 1599]
    values = torch.randint(1, 99, (len(index),), dtype=torch.int16, generator=g).numpy()
    gaps, longs = _gaps_of(index)
    delta_kernels.scatter_gaps(runs, gaps, longs, values)
    expected_a, expected_b = (
        torch.zeros(4, 270, dtype=torch.int16),
        torch.zeros(500, dtype=torch.int16),
    )
    expected_a.view(-1)[index[:5]] = torch.from_numpy(values[:5])
    expected_b[[i - 1100 for i in index[5:]]] = torch.from_numpy(values[5:])
    assert torch.equal(a, expected_a) and torch.equal(b, expected_b)
    assert int(wide[:, :10].abs().sum() + wide[:, 280:].abs().sum()) == 0
    for bad in ([5, 1090], [5, 1600]):  # in the hole; past the last run
        gaps, longs = _gaps_of(bad)
        with pytest.raises(ValueError, match=r"does not fit its message's runs"):
            delta_kernels.scatter_gaps(runs, gaps, longs, values[:2])
