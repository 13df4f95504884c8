"""Lark grammars rewritten in xgrammar's EBNF (``sampling.lark_grammar``)."""

import pytest

from minipaged.sampling.lark_grammar import lark_to_ebnf, looks_like_lark


def test_rules_alternatives_quotes_and_character_classes():
    lark = """// comment line
?start: item+        // a trailing comment
item.2: "a//b" | 'it\\'s'
      | DIGITS
DIGITS: /[0-9]+/
"""
    assert lark_to_ebnf(lark).splitlines() == [
        'root ::= item+',
        'item ::= "a//b" | "it\'s" | DIGITS',
        'DIGITS ::= [0-9]+',
    ]


def test_an_optional_in_brackets_is_not_a_character_class():
    assert lark_to_ebnf('start: "a" ["b" [c]] "[x]"\nc: /[0-9]/') == (
        'root ::= "a" ("b" (c)?)? "[x]"\nc ::= [0-9]')


def test_start_is_renamed_where_it_is_referenced_but_not_inside_strings():
    assert lark_to_ebnf('start: "start" start?') == 'root ::= "start" root?'


def test_ebnf_is_told_apart_from_lark():
    assert looks_like_lark('start: "a"')
    assert not looks_like_lark('root ::= "a" // start: "b"\n')
    assert looks_like_lark('start: "::=" // root ::= x')


@pytest.mark.parametrize("grammar, says", [
    ('%ignore " "\nstart: "a"', "%ignore"),
    ('start: /a|b/', "regular expression"),
    ('item: "a"', "'start' rule"),
    ('| "a"', "continues no rule"),
    ('start "a"', "not a Lark rule"),
    ('start:', "empty body"),
])
def test_what_has_no_ebnf_counterpart_is_refused(grammar, says):
    with pytest.raises(ValueError, match=says):
        lark_to_ebnf(grammar)


def test_the_ebnf_compiles_with_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    ebnf = lark_to_ebnf('start: pair ("," pair)*\npair: KEY "=" /[0-9]+/\nKEY: /[a-z]+/')
    assert "root ::=" in str(xgr.Grammar.from_ebnf(ebnf))
