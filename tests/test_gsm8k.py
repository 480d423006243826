"""The GSM8K answer parser and the GSM8K-format sample file of the GSM8K chapter (`oelm_nb.studies.mercator.gsm8k`), on tricky strings."""
from __future__ import annotations
import json
from decimal import Decimal

import pytest
from oelm_nb.studies.mercator.gsm8k import gsm8k_number, gsm8k_correct, gsm8k_sample, write_gsm8k_sample


@pytest.mark.parametrize('text, number', [
    ('Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72', Decimal(72)),
    ('#### 1,234,567', Decimal(1234567)),                 # thousands separators
    ('#### -12', Decimal(-12)),                           # negative
    ('#### \u221212', Decimal(-12)),                      # a typographic minus
    ('#### 18 dollars per week.', Decimal(18)),           # trailing text and a full stop
    ('#### $1,000.50', Decimal('1000.50')),               # currency and decimals
    ('#### 0.5', Decimal('0.5')),
    ('I think 3 then 4, #### 5 and later 6', Decimal(5)),  # the number right after ####, not the last one
    ('she has 3 apples, then 7', Decimal(7)),             # no ####: the last number (lenient)
    ('no digits here', None),
    ('#### none', None),                                  # #### without a number and nothing before it
])
def test_gsm8k_number(text, number):
    assert gsm8k_number(text) == number


def test_strict_reading_needs_the_marker():
    assert gsm8k_number('the answer is 7', strict=True) is None
    assert gsm8k_number('the answer is #### 7', strict=True) == Decimal(7)


@pytest.mark.parametrize('prediction, reference, ok', [
    ('#### 1000', '#### 1,000', True), ('#### 1000.00', '#### 1000', True), ('so 72', 'blah #### 72', True),
    ('#### 71', '#### 72', False), ('#### -5', '#### 5', False), ('', '#### 5', False),
    ('#### 5', 'a reference without a final answer', False), ('#### 5', 'costs 5', False),  # the reference must have ####
])
def test_gsm8k_correct(prediction, reference, ok):
    assert gsm8k_correct(prediction, reference) is ok


def test_sample_file_is_gsm8k_format_and_self_consistent(tmp_path):
    path = write_gsm8k_sample(tmp_path / 'sub' / 'gsm8k.jsonl', 40, seed=5)
    recs = [json.loads(l) for l in path.read_text().splitlines()]
    assert recs == gsm8k_sample(40, seed=5) and len(recs) == 40 and set(recs[0]) == {'question', 'answer'}
    for r in recs:
        assert r['answer'].count('####') == 1 and '<<' in r['answer']
        # the stated answer is the arithmetic of the last calculator annotation
        last = r['answer'].rsplit('<<', 1)[1].split('>>')[0]
        expr, result = last.split('=')
        op = next(o for o in '+-*' if o in expr)
        a, b = (Decimal(x) for x in expr.split(op))
        assert {'+': a + b, '-': a - b, '*': a * b}[op] == Decimal(result) == gsm8k_number(r['answer'], strict=True)
    assert gsm8k_sample(40, seed=6) != recs
