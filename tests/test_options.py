"""One `PlanOptions` carries the planning choices from every face (optimize, fit, backend, cli) down to the
stages: given as an object or as keywords, never as a silent mix of both, and checked once."""

import argparse
import dataclasses

import pytest
import torch

import autoremat
from autoremat.cli import _options
from autoremat.planning.options import DEFAULTS, PlanOptions, split_options
from examples import models


def _mlp():
    torch.manual_seed(0)
    return models.mlp(batch=8, width=32, depth=2)


def test_keywords_and_an_options_object_plan_the_same():
    model, ex = _mlp()
    by_keywords = autoremat.optimize(model, budget="1GB", example_inputs=ex, compiler="eager", time_limit=5.0,
                                     optimizer=None)
    by_object = autoremat.optimize(model, budget="1GB", example_inputs=ex, optimizer=None,
                                   options=PlanOptions(compiler="eager", time_limit=5.0))
    for om in (by_keywords, by_object):
        assert om.plan.compiler["used"] == "eager"
    assert by_keywords.plan.predicted_peak == by_object.plan.predicted_peak
    assert [g.saved for g in by_keywords.plan.graphs] == [g.saved for g in by_object.plan.graphs]


def test_an_options_object_and_a_keyword_together_are_refused():
    model, ex = _mlp()
    with pytest.raises(ValueError, match="options= and also the keyword.*compiler"):
        autoremat.optimize(model, budget="1GB", example_inputs=ex, compiler="eager", options=PlanOptions())
    with pytest.raises(TypeError, match="options must be an autoremat.PlanOptions, got dict"):
        autoremat.optimize(model, budget="1GB", example_inputs=ex, options={"compiler": "eager"})


def test_options_given_as_an_object_are_checked_like_keywords():
    model, ex = _mlp()
    with pytest.raises(ValueError, match="time_limit must be a positive"):
        autoremat.optimize(model, budget="1GB", example_inputs=ex, options=PlanOptions(time_limit=0))


def test_split_options_parts_a_faces_keywords():
    options, rest = split_options(None, {"solver": "highs", "gap": 0.01, "world_size": 2, "progress": False})
    assert options == dataclasses.replace(DEFAULTS, solver="highs", gap=0.01)
    assert rest == {"world_size": 2, "progress": False}
    given = PlanOptions(compiler="eager")
    assert split_options(given, {"sharding": "none"}) == (given, {"sharding": "none"})


def test_the_backend_hands_its_planner_one_checked_options_object():
    be = autoremat.backend(budget="1GB", compiler="eager", time_limit=3.0)
    assert be.planner.options == dataclasses.replace(DEFAULTS, compiler="eager", time_limit=3.0)
    with pytest.raises(ValueError, match="gap must be"):
        autoremat.backend(budget="1GB", gap=2.0)


def test_the_command_line_builds_the_options_it_asked_for():
    args = argparse.Namespace(solver="highs", time_limit=7.0, precision="bf16", outputs="loss", compiler="eager")
    assert _options(args) == PlanOptions(solver="highs", time_limit=7.0, precision="bf16", outputs="loss",
                                         compiler="eager")
