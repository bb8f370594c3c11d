"""Putting output pieces back in order (``controller/output_order.py``), on plain objects."""

from __future__ import annotations

from dataclasses import dataclass

from controller.output_order import OutputOrder


@dataclass(frozen=True)
class Piece:
    token_ids: list
    text: str
    position: int
    text_offset: int
    logprobs: tuple = ()
    finished: bool = False
    index: int = 0
    prompt_logprobs: tuple | None = None


def _emitted(order: OutputOrder, pieces) -> tuple[list, str]:
    out = [cut for p in pieces for cut in order.accept(p)]
    return [t for c in out for t in c.token_ids], "".join(c.text for c in out)


def test_in_order_pieces_pass_unchanged():
    order = OutputOrder()
    p = Piece([1, 2], "ab", 0, 0)
    assert order.accept(p) == [p] and order.emitted_tokens() == 2


def test_repeats_are_cut_and_early_pieces_wait_for_the_gap():
    order = OutputOrder()
    ids, text = _emitted(order, [
        Piece([10], "", 0, 0),  # the first token, without text (prefill)
        Piece([12, 13], "cd", 2, 2),  # arrives before position 1: waits
        Piece([10, 11], "ab", 0, 0),  # repeats 10 and its text comes with it: fills the gap
        Piece([11, 12], "bc", 1, 1),  # nothing new
    ])
    assert ids == [10, 11, 12, 13] and text == "abcd" and order.emitted_tokens() == 4


def test_cut_keeps_log_probabilities_aligned_with_ids():
    order = OutputOrder()
    order.accept(Piece([1, 2], "xy", 0, 0, logprobs=("l1", "l2")))
    (cut,) = order.accept(Piece([2, 3], "yz", 1, 1, logprobs=("l2", "l3")))
    assert cut.token_ids == [3] and cut.logprobs == ("l3",) and cut.text == "z"
    assert (cut.position, cut.text_offset) == (2, 2)


def test_a_repeat_that_finishes_is_still_emitted():
    order = OutputOrder()
    order.accept(Piece([7], "", 0, 0))
    (cut,) = order.accept(Piece([7], "", 0, 0, finished=True))
    assert cut.token_ids == [] and cut.finished


def test_sequences_are_ordered_independently():
    order = OutputOrder()
    assert order.accept(Piece([5], "e", 1, 1, index=1)) == []  # waits for index 1's position 0
    assert [c.token_ids for c in order.accept(Piece([4], "d", 0, 0, index=1))] == [[4], [5]]
    assert order.emitted_tokens(0) == 0 and order.emitted_tokens(1) == 2 and order.emitted_tokens() == 2


def test_text_behind_its_tokens_waits_for_the_text_before_it():
    order = OutputOrder()
    order.accept(Piece([1], "", 0, 0))
    assert order.accept(Piece([2], "b", 1, 1)) == []  # the text of token 1 ("a") has not come yet
    ids, text = _emitted(order, [Piece([1], "a", 0, 0)])
    assert ids == [2] and text == "ab"
