"""Chat-template deltas: a trajectory built from the prompt's ids, each model turn's ids and the
environment's deltas is token for token the template's rendering of the whole conversation,
under the Qwen2.5 and SmolLM2 templates, with and without tools."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from megarl.envs import ChatDeltas, EnvError
from megarl.envs.builtin_tools import calculator_tool, python_tool
from megarl.tools.testing.assets import QWEN25_TOOLS_TEMPLATE
from tests.assets import qwen25_tokenizer_dir, smollm2_dir

pytestmark = pytest.mark.unit

TOOLS = [calculator_tool().schema, python_tool().schema]


def _call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# (model turn text, environment messages after it); the last turn is the final answer
TURNS = [
    (
        _call("calculator", expression="123 + 456") + "\n" + _call("python", code="print(7*8)"),
        [{"role": "tool", "content": "579"}, {"role": "tool", "content": "56\n"}],
    ),
    ("Not sure yet.", [{"role": "user", "content": "Keep going: what is 579 * 56?"}]),
    (_call("calculator", expression="579 * 56"), [{"role": "tool", "content": "32424"}]),
    ("The answer is 32424.", None),
]


@pytest.fixture(scope="module")
def tokenizers():
    qwen = AutoTokenizer.from_pretrained(qwen25_tokenizer_dir())
    qwen_tools = AutoTokenizer.from_pretrained(qwen25_tokenizer_dir())
    qwen_tools.chat_template = QWEN25_TOOLS_TEMPLATE
    return {
        "qwen2.5": qwen,
        "qwen2.5-tools": qwen_tools,
        "smollm2": AutoTokenizer.from_pretrained(smollm2_dir()),
    }


def _trajectory(tok, deltas: ChatDeltas, start: list[dict], tools) -> tuple[list[int], list]:
    """The ids a multi-turn rollout builds (model turns: their text's ids + EOS, as a model that
    wrote exactly that text samples them), and the conversation they stand for."""
    ids = deltas.prompt_ids(start, tools)
    conversation = list(start)
    stop = tok.decode([tok.eos_token_id])
    for text, env in TURNS:
        ids += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        conversation.append({"role": "assistant", "content": text})
        if env is not None:
            ids += deltas.env_ids(env, stop, tools)
            conversation += env
    return ids, conversation


@pytest.mark.parametrize("name", ["qwen2.5", "qwen2.5-tools", "smollm2"])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("with_system", [False, True])
def test_deltas_equal_the_template_on_the_whole_conversation(
    tokenizers, name, with_tools, with_system
):
    tok = tokenizers[name]
    deltas = ChatDeltas(tok)
    tools = TOOLS if with_tools else None
    start = [{"role": "user", "content": "What is (123 + 456) * 56?"}]
    if with_system:
        start.insert(0, {"role": "system", "content": "Use the tools."})
    ids, conversation = _trajectory(tok, deltas, start, tools)
    whole = tok.apply_chat_template(conversation, tools=tools, tokenize=False)
    # the template closes the last assistant turn with more than the model's stop token
    closing = deltas.turn_close(tok.decode([tok.eos_token_id]), tools)
    assert whole.endswith(closing)
    expected = tok(whole, add_special_tokens=False)["input_ids"]
    assert ids + tok(closing, add_special_tokens=False)["input_ids"] == expected
    assert tok.decode(ids) + closing == whole
    if name == "qwen2.5-tools":
        # two tool results of one turn are one user turn of <tool_response> blocks
        assert deltas.renders_tools and whole.count("<|im_start|>user") == 4
        assert "579\n</tool_response>\n<tool_response>\n56\n" in whole
        assert ("# Tools" in whole) == with_tools
    else:
        assert not deltas.renders_tools


def test_a_turn_cut_by_its_token_limit_is_closed_by_the_template(tokenizers):
    tok = tokenizers["qwen2.5"]
    deltas = ChatDeltas(tok)
    start = [{"role": "user", "content": "Count to ten."}]
    ids = deltas.prompt_ids(start)
    cut = tok("1, 2, 3", add_special_tokens=False)["input_ids"]  # no <|im_end|>: cut short
    env = [{"role": "user", "content": "Go on."}]
    ids += cut + deltas.env_ids(env, stop_text=None)
    conversation = [*start, {"role": "assistant", "content": "1, 2, 3"}, *env]
    whole = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ids == tok(whole, add_special_tokens=False)["input_ids"]


def test_a_role_the_template_drops_or_refuses_is_an_error(tokenizers):
    tok = AutoTokenizer.from_pretrained(qwen25_tokenizer_dir())
    # a template that renders only user and assistant turns, silently skipping the rest
    tok.chat_template = (
        "{%- for m in messages %}{%- if m['role'] in ['user', 'assistant'] %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    deltas = ChatDeltas(tok)
    with pytest.raises(EnvError, match="does not render a message of role 'tool'"):
        deltas.env_ids([{"role": "tool", "content": "579"}], "<|im_end|>")
    assert deltas.env_ids([{"role": "user", "content": "ok"}], "<|im_end|>")
    tok.chat_template = (
        "{%- for m in messages %}{%- if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{%- endif %}{{- m['content'] }}{%- endfor %}"
    )
    with pytest.raises(EnvError, match="cannot render a conversation with roles"):
        ChatDeltas(tok).prompt_ids([{"role": "tool", "content": "x"}])
