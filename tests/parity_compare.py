"""How a scenario's checkpoints are compared with its reference's: the
tolerances by checkpoint label (fp32; the [bf16], [fp16] and
[bf16-rounded] labels), ReducedSum (a sum of low-precision terms and the
bound any order of adding them stays within) and compare(), which every
scenario suite uses."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch


RTOL, ATOL = 1e-5, 1e-6


# Checkpoint label prefixes compared at low-precision tolerances (see compare()).
BF16, FP16 = "[bf16] ", "[fp16] "
LOW_PRECISION_LABEL = {torch.bfloat16: BF16, torch.float16: FP16}


# [bf16] and [fp16] labels: low-precision training (8 and 11 significant
# bits). Where the reference records a gradient as a ReducedSum (the
# scenarios of parity_mixed_scenarios.py), the rounding of its reduction, in any
# order, is the ReducedSum's own bound, derived from its terms; these rtol
# and atol cover the rest: what that rounding changes later (masters
# stepped from gradients that differ by it, compute-dtype parameters
# rounded from the masters to neighbours, the gradients those give); in
# suites whose references record autograd's own sum of the ranks' gradients
# in the compute dtype (whole-parameter optimizers, frozen mixed precision),
# that sum's rounding too. tests/test_tolerances.py perturbs the references so.
BF16_RTOL, BF16_ATOL = 2e-2, 2e-3
FP16_RTOL, FP16_ATOL = 1e-2, 1e-3
# A value computed in fp32 and then cast to bf16 (output_dtype_cast's
# output): fp32 values that differ by rounding alone cast to the same bf16
# value or to neighbours one bf16 ulp apart, and with 8 significant bits an
# ulp is at most 2**-7 of the value; ATOL covers fp32 noise around zero.
BF16_ROUNDED = "[bf16-rounded] "
BF16_ROUNDED_RTOL, BF16_ROUNDED_ATOL = 2.0 ** -7, ATOL
# (rtol, atol) by checkpoint label prefix; other labels compare at RTOL, ATOL.
TOLERANCES: Dict[str, Tuple[float, float]] = {
    BF16: (BF16_RTOL, BF16_ATOL), FP16: (FP16_RTOL, FP16_ATOL), BF16_ROUNDED: (BF16_ROUNDED_RTOL, BF16_ROUNDED_ATOL)}


def tolerance_of(label: str, tolerances: Dict[str, Tuple[float, float]]) -> Tuple[float, float]:
    return next((tol for prefix, tol in tolerances.items() if label.startswith(prefix)), (RTOL, ATOL))


def within(got: torch.Tensor, want: torch.Tensor, rtol: float, atol) -> bool:
    """|got - want| <= atol + rtol * |want| elementwise (atol a number or a tensor); NaN never is."""
    return bool(((got - want).abs() <= atol + rtol * want.abs()).all())


@dataclasses.dataclass
class ReducedSum:
    """A reference gradient that is a sum of low-precision terms, as zero_ext
    must reduce it: `value`, their exact sum (fp32), and `bound`, elementwise,
    the most any order of adding them in the compute dtype or finer may move
    it. compare() takes got within `bound` (besides its label's rtol and
    atol) of `value`.

    With m terms t_i, S = sum |t_i| and u the compute dtype's unit roundoff
    (half an ulp relative: 2**-8 for bf16, 2**-11 for fp16), any sum of them
    by m - 1 additions, each rounded to a precision of u or finer, lies within
    gamma(m - 1) * S of the exact sum, gamma(n) = n*u / (1 - n*u) (Higham,
    Accuracy and Stability of Numerical Algorithms, 4.2): each addition
    rounds its result by at most u times itself (a subnormal result adds
    exactly), and no partial sum exceeds S(1+u)**k. A bound relative to the
    sum itself cannot hold: where the terms cancel, S is many times |sum|.
    zero_ext adds the same terms (each rank's, from the same compute-dtype
    parameters and kernels, divided by a power-of-two world size: exactly) by
    m - 1 additions in the compute dtype, the reduction dtype or its fp32
    accumulator. The bound is what one backward's rounding may do; after a
    step, the two runs' parameters may differ too (their label's rtol and
    atol cover that)."""
    value: torch.Tensor
    bound: torch.Tensor


UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def summation_bound(terms: int, unit_roundoff: float) -> float:
    """gamma(terms - 1): the most rounding moves a sum of `terms` terms, per unit of sum |term|."""
    n = max(terms - 1, 0)
    assert n * unit_roundoff < 1
    return n * unit_roundoff / (1 - n * unit_roundoff)


def compare(ref, got, tolerances: Optional[Dict[str, Tuple[float, float]]] = None) -> Optional[str]:
    """First mismatch between two checkpoint lists, or None. Lists that
    compare nothing are refused as a mismatch: a scenario that recorded
    nothing (or only Nones) would otherwise pass whatever zero_ext did.
    A reference value recorded as a ReducedSum allows its bound besides
    the label's rtol and atol.
    `tolerances`: more label prefixes and their (rtol, atol), beside TOLERANCES."""
    tolerances = {**TOLERANCES, **(tolerances or {})}
    if not ref or not got:
        return (f"nothing to compare: {len(got)} checkpoints, reference has {len(ref)} "
                f"(every scenario must record at least one)")
    if len(ref) != len(got):
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a[0] != b[0]), min(len(ref), len(got)))
        return (f"{len(got)} checkpoints, reference has {len(ref)}; first difference at #{first}: "
                f"{got[first][0] if first < len(got) else 'none'!r} vs reference "
                f"{ref[first][0] if first < len(ref) else 'none'!r}")
    compared = 0
    for (label, want), (label2, have) in zip(ref, got):
        if label != label2:
            return f"checkpoint {label2!r} where the reference has {label!r}"
        if not want:
            return f"{label}: recorded no values"
        if set(want) != set(have):
            return f"{label}: keys {sorted(have)} != reference {sorted(want)}"
        for key in want:
            a, b = want[key], have[key]
            bound = None
            if isinstance(a, ReducedSum):  # the exact sum, and what rounding may move it by
                a, bound = a.value, a.bound
            if isinstance(b, ReducedSum):  # another reference's
                b = b.value
            if a is None or b is None:
                if a is not None or b is not None:
                    return f"{label} [{key}]: got {'None' if b is None else 'a tensor'}, reference {'None' if a is None else 'a tensor'}"
                continue
            compared += 1
            if a.dtype == torch.bool:
                if not bool(b):
                    return f"{label}: check failed"
                continue
            rtol, atol = tolerance_of(label, tolerances)
            if a.shape != b.shape or not (torch.allclose(b.float(), a.float(), rtol=rtol, atol=atol) if bound is None
                                          else within(b.float(), a.float(), rtol, atol + bound)):
                diff = (b.float() - a.float()).abs().max().item() if a.shape == b.shape else "shape"
                return f"{label} [{key}]: max abs diff {diff}"
    if not compared:
        return f"nothing compared: all {len(ref)} checkpoints hold only None (no gradients or values recorded)"
    return None
