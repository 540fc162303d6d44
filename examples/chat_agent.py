"""A black-box agent of your own, written against an OpenAI-compatible endpoint only (docs/agents.md, "Agents of
your own"): any client that takes a base URL works unchanged (``openai.AsyncOpenAI(base_url=base_url,
api_key="-")``, LangChain, plain httpx as here).

    task:
      type: agent
      agent: chat_agent:solve           # this file, in the directory `miles run` starts in
      train_path: train.jsonl           # {"prompt": "...", "answer": "..."} per line
      eval_path: eval.jsonl

Per episode the rollout worker serves the endpoint at ``base_url`` and records every call: the model's answers
are trained token for token, what the agent adds between calls is context (loss mask 0).
"""

from __future__ import annotations

import httpx

from miles.tasks.base import Sample, first_answer


async def solve(base_url: str, sample: Sample) -> float:
    """Ask the question, then ask the model to check its answer; reward 1 if the checked answer is right."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        messages = [{"role": "user", "content": sample.prompt}]
        for follow_up in ("check:", None):
            response = await client.post("/chat/completions", json={"model": "policy", "messages": messages})
            if response.status_code != 200:  # the episode ended at a limit (HTTP 409): score what we have
                break
            answer = response.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
    final = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
    return 1.0 if first_answer(final) == sample.answer else 0.0
