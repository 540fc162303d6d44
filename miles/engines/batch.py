"""Many prompts through a per-request engine, for code that thinks in batches (evaluation, warm-up, tests).

Engines take requests one at a time (:meth:`~miles.engines.base.Engine.generate`); batching is theirs to
do. These helpers only submit every prompt at once and collect the results in order.
"""

from __future__ import annotations

import asyncio

from miles.engines.base import Engine, Generation, SamplingParams


async def generate_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
    """One completion per prompt, all in flight together, in prompt order. The engine must be started.

    If a request fails, the others are cancelled and that failure is raised as it is (not wrapped in an
    exception group), so callers can catch ``EngineError`` or ``ValueError``.
    """
    tasks = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def generate_all_sync(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
    """:func:`generate_all` from synchronous code: starts ``engine`` in a fresh event loop, closes it after.

    For code outside asyncio only (it calls ``asyncio.run``); pass an engine that is not started. Both
    engines may be started again afterwards.
    """

    async def run() -> list[Generation]:
        await engine.start()
        try:
            return await generate_all(engine, prompts, params)
        finally:
            await engine.close()

    return asyncio.run(run())
