"""``ForwardState``: what a recompute replays of its forward (random numbers, autocast), captured once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jobs.recompute import ForwardState, in_recompute, only_first_rows_need_gradient, recomputing, rows_needing_gradient


def test_a_replay_draws_the_forwards_random_numbers_and_leaves_the_generator_as_it_was() -> None:
    x = torch.ones(4, 64)
    state = ForwardState.capture(x)
    forward = F.dropout(x, 0.5)
    assert state.drew_random_numbers()
    after = torch.get_rng_state()
    with state.replay():
        again = F.dropout(x, 0.5)
    assert torch.equal(forward, again)
    assert torch.equal(torch.get_rng_state(), after)  # the recompute does not shift the training's stream


def test_a_forward_without_random_numbers_is_seen_as_such() -> None:
    x = torch.ones(2, 3)
    state = ForwardState.capture(x)
    _ = x * 2
    assert not state.drew_random_numbers()


def test_a_replay_restores_the_forwards_autocast() -> None:
    x = torch.ones(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = ForwardState.capture(x)
    assert not torch.is_autocast_enabled("cpu")
    with state.replay(random_numbers=False):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (x @ x.T).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_the_flags_nest_and_restore() -> None:
    assert not recomputing() and rows_needing_gradient(8) is None
    with only_first_rows_need_gradient(4):
        assert rows_needing_gradient(8) == 4 and rows_needing_gradient(4) is None  # no fewer rows than all
        with torch.no_grad():
            assert rows_needing_gradient(8) is None  # nothing is kept without a graph
        with in_recompute():
            assert recomputing()
            with in_recompute():
                assert recomputing()
            assert recomputing()
        assert not recomputing()
    assert rows_needing_gradient(8) is None
