"""autoremat.solve.lp, the one module that speaks PuLP: the same answers on whichever major is installed
(PuLP 3 on Python 3.10-3.11, PuLP 4 on 3.12+; CI runs this file on both)."""

from __future__ import annotations

import random

import pulp
import pytest

from autoremat.solve import lp


def knapsack(capacity: float) -> tuple[lp.Problem, dict[str, lp.Variable]]:
    """Keep the most value within `capacity`: items a (value 3, weight 2), b (4, 3), c (5, 4).
    By hand: capacity 5 keeps a and b (value 7: a+c weighs 6, b+c 7); capacity 1 keeps nothing."""
    prob = lp.problem("knapsack")
    x = {k: lp.binary(prob, f"x_{k}") for k in "abc"}
    weight = {"a": 2, "b": 3, "c": 4}
    value = {"a": 3, "b": 4, "c": 5}
    prob += pulp.lpSum(weight[k] * x[k] for k in x) <= capacity
    prob.setObjective(-pulp.lpSum(value[k] * x[k] for k in x))
    return prob, x


def test_a_binary_program_solves_to_the_hand_worked_optimum():
    prob, x = knapsack(5)
    status = lp.solve(prob, lp.highs(time_limit=10, gap=0))
    assert status == lp.OPTIMAL and lp.has_solution(status)
    assert {k for k, v in x.items() if v.value() > 0.5} == {"a", "b"}


def test_an_infeasible_program_says_so():
    prob, x = knapsack(5)
    prob += x["c"] >= 1  # c alone weighs 4; with c, a or b must go, and then force both in too
    prob += x["a"] + x["b"] >= 2
    status = lp.solve(prob, lp.highs(time_limit=10, gap=0))
    assert status == lp.INFEASIBLE and not lp.has_solution(status)


def test_expressions_and_continuous_bounds():
    """zero() and of() build the expressions the ILP chains its running sums from; a continuous
    variable's bounds can be moved between solves (how one model is re-solved under new budgets)."""
    prob = lp.problem("chain")
    cap = lp.continuous(prob, "cap", 0)
    m = lp.continuous(prob, "m")  # free
    acc = lp.zero() + 7
    prob += m == acc + 3  # m = 10
    prob += lp.of(m) <= cap
    prob.setObjective(lp.of(cap))
    assert lp.solve(prob, lp.highs(10, 0)) == lp.OPTIMAL
    assert pulp.value(cap) == pytest.approx(10)
    cap.lowBound = cap.upBound = 9  # below what m needs
    assert lp.solve(prob, lp.highs(10, 0)) == lp.INFEASIBLE
    assert lp.constraint_count(prob) == 2


def split_in_half(n: int = 40) -> tuple[lp.Problem, list[lp.Variable], list[int], int]:
    """Pick items of weights 1000-2000 (values within 50 of each weight) worth the most within half their
    total weight: near-equal ratios leave the root relaxation loose, so HiGHS needs branching to prove its
    answer, and its interrupt callback runs."""
    rng = random.Random(0)
    weight = [rng.randint(1000, 2000) for _ in range(n)]
    value = [w + rng.randint(-50, 50) for w in weight]
    prob = lp.problem("split")
    x = [lp.binary(prob, f"x{i}") for i in range(n)]
    half = sum(weight) // 2
    prob += pulp.lpSum(w * xi for w, xi in zip(weight, x)) <= half
    prob.setObjective(-pulp.lpSum(v * xi for v, xi in zip(value, x)))
    return prob, x, weight, half


def test_a_mip_stops_at_stop_at_holding_a_solution():
    """stop_at=(0, -inf): every solution (all objectives are negative) and every bound pass it, so HiGHS
    stops at its first solution, reported as a solution found early (TIME_LIMIT) that keeps every row;
    without it, or with an objective no solution reaches, the MIP is solved to the end."""
    prob, x, weight, half = split_in_half()
    assert lp.solve(prob, lp.highs(10, 0)) == lp.OPTIMAL
    best = pulp.value(prob.objective)
    prob, x, weight, half = split_in_half()
    status = lp.solve(prob, lp.highs(10, 0, stop_at=(0.0, float("-inf"))))
    assert status == lp.TIME_LIMIT and lp.has_solution(status)
    assert sum(w for w, xi in zip(weight, x) if xi.value() > 0.5) <= half
    assert pulp.value(prob.objective) >= best
    prob, x, weight, half = split_in_half()
    assert lp.solve(prob, lp.highs(10, 0, stop_at=(best - 1, float("-inf")))) == lp.OPTIMAL
    assert pulp.value(prob.objective) == pytest.approx(best)
    assert type(lp.highs(10, 0, stop_at=(0.0, 0.0))).__name__ == "HiGHS"  # the name plans show


def test_the_installed_major_is_one_the_adapter_knows():
    assert lp.PULP_MAJOR in (3, 4), pulp.__version__
