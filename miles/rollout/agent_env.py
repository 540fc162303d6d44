"""A black-box agent as an environment: the agent calls a chat endpoint, the episode runner samples the answers.

The agent (a user's ``async def run_agent(base_url, sample) -> reward``) runs in the worker's event loop and
talks to its episode's OpenAI-compatible endpoint (:mod:`miles.rollout.agent_server`). Seen from the episode
runner (:mod:`miles.rollout.episode`) it is an ordinary environment, so tokens, loss masks, versions and limits
are exactly those of every episode:

* ``reset`` starts the agent and waits for its first call: that call's messages open the episode;
* the runner samples the model's turn and hands its text to ``step``, which answers the pending call with it
  and waits for the agent's next call: the messages it appends after that answer are the environment's turn
  (tokenised once, loss mask 0); or for the agent's return, which ends the episode (``done``);
* ``reward`` is what the agent returned.

A call must extend the conversation so far (the earlier messages and the answers it got, unchanged): then the
model sees exactly the tokens it generated, never a re-tokenisation. A call that rewrites the history (drops or
edits earlier messages) is refused with HTTP 409 and counted (``agent_history_rewrites``), and the episode ends
there, scored by what the agent then returns. So is any call after the episode ended at a limit (``max_turns``,
``max_tokens``, ``timeout``): HTTP 409 saying why. A request's sampling parameters and tool definitions are not
used: the run's ``rollout.sampling`` governs every turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from miles.rollout.agent_server import CallRefused, Session, agent_server
from miles.rollout.env import ChatMessage, EnvStep, InfraError
from miles.tasks.base import Sample

AgentFn = Callable[[str, Sample], Awaitable[Any]]  # (base_url, sample) -> reward


class _Call:
    """One pending chat call: its messages, and the answer the agent awaits."""

    def __init__(self, messages: list[ChatMessage]) -> None:
        self.messages = messages
        self.answer: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()


class AgentEnv:
    """:class:`~miles.rollout.env.Environment` of one agent run (module docstring)."""

    def __init__(self, agent: AgentFn, sample: Sample) -> None:
        self.agent = agent
        self.sample = sample
        self._calls: asyncio.Queue[_Call] = asyncio.Queue()
        self._task: asyncio.Task[Any] | None = None
        self._session: Session | None = None
        self._pending: _Call | None = None
        self._history: list[ChatMessage] = []  # the conversation the model has seen
        self._ended: str | None = None  # why calls are refused from now on

    async def _handle(self, messages: list[ChatMessage]) -> tuple[str, str]:
        if self._ended is not None:
            raise CallRefused(409, self._ended)
        call = _Call(messages)
        await self._calls.put(call)
        return await call.answer

    async def _next(self) -> _Call | None:
        """The agent's next call, or None once it returned (its reward is then ready)."""
        assert self._task is not None
        get = asyncio.ensure_future(self._calls.get())
        try:
            await asyncio.wait({get, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
        return get.result() if get.done() and not get.cancelled() else None

    async def reset(self) -> list[ChatMessage]:
        self._session = await agent_server().open(self._handle)
        self._task = asyncio.create_task(self.agent(self._session.base_url, self.sample))
        call = await self._next()
        if call is None:  # excluded and counted (infra_error), never a worker's crash
            error = self._task.exception()
            why = f"raised {type(error).__name__}: {error}" if error is not None else "returned"
            raise InfraError(f"the agent {why} before calling the model")
        self._pending = call
        self._history = list(call.messages)
        return list(call.messages)

    async def step(self, action: str) -> EnvStep:
        assert self._pending is not None
        self._pending.answer.set_result((action, "stop"))
        self._history.append({"role": "assistant", "content": action})
        self._pending = None
        call = await self._next()
        if call is None:
            return EnvStep(done=True, end_reason="done")
        seen = len(self._history)
        if call.messages[:seen] != self._history or len(call.messages) == seen:
            self._end(call, "the call rewrites the conversation so far (or adds nothing to it): not trained")
            return EnvStep(done=True, end_reason="done", info={"agent_history_rewrites": 1.0})
        new = call.messages[seen:]
        self._pending = call
        self._history.extend(new)
        return EnvStep(messages=new)

    def _end(self, call: _Call | None, why: str) -> None:
        self._ended = f"episode over: {why}"
        if call is not None and not call.answer.done():
            call.answer.set_exception(CallRefused(409, self._ended))

    async def reward(self) -> Any:
        """What the agent returned; an episode ended at a limit first refuses the call the agent waits on."""
        assert self._task is not None
        if not self._task.done():
            if self._ended is None:
                self._end(self._pending, "a limit of the episode was reached (max_turns, max_tokens or timeout)")
            while not self._task.done():  # refuse what it still asks until it returns its reward
                call = await self._next()
                if call is not None and not call.answer.done():
                    call.answer.set_exception(CallRefused(409, self._ended or "episode over"))
        return self._task.result()

    async def close(self) -> None:
        if self._ended is None:
            self._end(self._pending, "the episode was closed")
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            agent_server().close(self._session)
