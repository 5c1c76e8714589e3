"""strata.serve's text machinery: stop sequences over streamed pieces, tool-call parsing, fields."""

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from strata.serve.fields import Fields, RequestError
from strata.stop_strings import StopMatcher, held_back
from strata.serve.tool_calls import ToolCallSplitter, parse_tool_calls


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_held_back_is_the_longest_suffix_that_starts_a_stop():
    assert held_back("abc<to", ("<tool_call>",)) == 3
    assert held_back("abc", ("xyz",)) == 0
    assert held_back("ab", ("b", "abc")) == 2
    assert held_back("stop", ("stop",)) == 0  # a whole match is not "held": the matcher cuts it


@given(st.text("ab\n", max_size=30), st.lists(st.integers(0, 40), max_size=8),
       st.lists(st.text("ab\n", min_size=1, max_size=3), min_size=1, max_size=3))
@example(text="\naa", cuts=[1, 2], stops=["a", "\naa"])  # "a" completes first, but "\naa" starts earlier
@example(text="\na", cuts=[1], stops=["a", "\naa"])  # ...and if the text ends there, "a" is the stop
def test_streamed_stop_matching_equals_cutting_the_whole_text(text, cuts, stops):
    matcher = StopMatcher(tuple(stops))
    shown = "".join(matcher.feed(p) for p in _split(text, cuts))
    if matcher.stopped is None:
        shown += matcher.flush()
    hits = [text.find(s) for s in stops if s in text]
    assert shown == (text[:min(hits)] if hits else text)
    assert (matcher.stopped is not None) == bool(hits)


def test_tool_calls_parse_in_qwen_form():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>')
    before, calls = parse_tool_calls(text)
    assert before == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


@pytest.mark.parametrize("text", ["<tool_call>{not json}</tool_call>", '<tool_call>["a"]</tool_call>',
                                  '<tool_call>{"arguments": {}}</tool_call>', "no call at all"])
def test_malformed_tool_calls_stay_text(text):
    assert parse_tool_calls(text) == (text, [])


@given(st.lists(st.integers(0, 120), max_size=10))
def test_the_splitter_streams_text_before_a_call_and_parses_it_at_the_end(cuts):
    text = 'Sure <t <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    splitter = ToolCallSplitter()
    shown = "".join(splitter.feed(p) for p in _split(text, cuts))
    tail, calls = splitter.finish()
    assert shown + tail == "Sure <t"  # the space before the call is not text
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 1})]


def test_the_splitter_shows_a_malformed_call_as_text():
    splitter = ToolCallSplitter()
    shown = splitter.feed("hi <tool_call> oops")
    tail, calls = splitter.finish()
    assert (shown + tail, calls) == ("hi <tool_call> oops", [])


def test_fields_name_the_field_and_refuse_leftovers():
    f = Fields({"n": 3, "t": True, "x": 1.5, "extra": 1}, "body")
    assert f.int("n", lo=1) == 3
    with pytest.raises(RequestError, match=r"body\.t: must be an integer"):
        f.int("t")  # a boolean is not an integer, whatever Python thinks
    with pytest.raises(RequestError, match=r"body\.x: must be a number in \[0, 1\], got 1.5"):
        f.number("x", lo=0, hi=1)
    with pytest.raises(RequestError, match=r"body\.extra: unknown field"):
        f.finish()


def test_tools_reach_the_template_as_transformers_hands_them():
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    from serve_support import CHAT_TEMPLATE

    from strata.chat_template import render_chat

    schema = {"type": "object", "properties": {"a": {"type": "number"}}}
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": schema}}]
    messages = [{"role": "user", "content": "2 + 3?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[messages], tools=tools, chat_template=CHAT_TEMPLATE, add_generation_prompt=True)
    ours = render_chat(CHAT_TEMPLATE, messages, tools=tools)
    assert ours == rendered[0] and '{"name": "add", "arguments": {"a": 2}}' in ours
