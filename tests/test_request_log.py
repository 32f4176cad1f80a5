"""`serve --log-requests` lines (serving/request_log.py): settings a request changed, lengths and times,
never text. The live server's lines are checked in tests/test_engine_process.py."""
from __future__ import annotations

import logging

from atlasjax import SamplingParams
from serving import request_log


def test_lines_name_what_changed_and_how_each_sequence_ended(caplog):
    caplog.set_level(logging.INFO, logger="atlasjax.requests")
    assert request_log.enabled()
    params = SamplingParams(n=2, temperature=0.5, stop=["secret stop"], logit_bias={1: 2.0}, allowed_token_ids=[4, 5])
    request_log.submitted("cmpl-1", 7, params, priority=-1)
    request_log.finished("cmpl-1", 1, "stop", 3, 0.0123, 0.25)
    request_log.aborted("cmpl-1", 1, 0.5)
    submitted, done, gone = (r.getMessage() for r in caplog.records)
    assert submitted == ("request cmpl-1: 7 prompt tokens, n=2, temperature=0.5, stop=[1], logit_bias=[1], "
                         "allowed_token_ids=[2], priority -1")
    assert done == "request cmpl-1 sequence 1: stop after 3 tokens, first token at 0.012 s, 0.250 s in all"
    assert gone == "request cmpl-1: the client went away after 0.500 s; unfinished sequences aborted: 1"
    assert request_log.params_summary(SamplingParams()) == "defaults"


def test_nothing_is_logged_without_the_flag(caplog):
    caplog.set_level(logging.WARNING, logger="atlasjax.requests")
    assert not request_log.enabled()
