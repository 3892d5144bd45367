"""The agent of the agent e2e runs, in a file of its own as a user's would be
(``rollout.agent=tests/e2e/openai_agent.py:three_turns``): the ``openai`` client and the standard
library only, loaded by path in the training processes."""

from __future__ import annotations

import os

import openai

VOWELS = set("aeiou")


def calculator(text: str) -> str:
    """The agent's own tool: the digits of the model's reply, summed."""
    return str(sum(int(c) for c in text if c.isdigit()))


def three_turns(row: dict, base_url: str, model: str) -> float:
    """Three model turns: after each of the first two, the agent answers as a tool (its own
    calculator on the reply, or the call the model made); the reward is the last reply's share of
    vowels. With AGENT_LOG set, one line per run is appended to that file."""
    if os.environ.get("AGENT_LOG"):
        with open(os.environ["AGENT_LOG"], "a") as f:
            f.write(f"{row['extra_info']}\n")
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    prompt = row["prompt"]
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    messages: list[dict] = [{"role": "user", "content": str(text)[:30]}]
    for turn in range(3):
        reply = client.chat.completions.create(model=model, messages=messages)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if turn < 2:
            calls = message.tool_calls or []
            result = calculator(message.content or "")
            for call in calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if not calls:
                messages.append({"role": "tool", "content": f"sum {result}"})
    last = message.content or ""
    return sum(c in VOWELS for c in last) / max(len(last), 1)
